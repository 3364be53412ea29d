"""Healing: bring a replica's global state to the run's, from its store and mirrors alone.

torchft heals a joining replica by sending it a peer's state over HTTP or the process group;
ours cannot reach each other. So a replica that starts while a run is going (new, restarted
after a crash, or relaunched after the whole run stopped), or whose state diverged from the
others', loads the newest committed checkpoint that reads back intact (``checkpoint.py``) and
replays every round sealed since, in order, through the outer optimizer (``global_state.py``).

Every step is checked. A loaded checkpoint must reproduce the fingerprint in its COMMIT, and
before each replayed round the replica's fingerprint must equal the one the round's
contributors sealed with, so a healed replica holds the others' global state bit for bit or
fails saying where it differs. Then it joins the first round that has no SEAL yet.

When the store has no intact checkpoint as new as a mirror's (``[checkpoint] mirrors``), the
mirror's is loaded, but only if the store confirms it belongs to this run: the round after it
must be sealed there from the state it holds (its fingerprint). A mirror can hold checkpoints
of an earlier run of the same name (started over with ``--fresh``); one of those would load
fine and take the replica somewhere the run never was.

Rounds are replayed as every replica decides them: a round sealed with fewer than
``min_replicas`` contributors, or one whose sealed data cannot be read intact (every replica
failed it alike), is skipped; every other sealed round was committed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from diloco_anywhere.bucket.store import Store, StoreError
from diloco_anywhere.bucket.wire import WireFormatError
from diloco_anywhere.collective.allreduce import BucketCollective
from diloco_anywhere.collective.round import RoundDataMissingError, SealedContributionError
from diloco_anywhere.training.checkpoint import (
    Checkpoint,
    CheckpointCommit,
    Confirm,
    newest_checkpoints,
)
from diloco_anywhere.training.global_state import GlobalState, fingerprint
from diloco_anywhere.training.manager import BucketManager

log = logging.getLogger(__name__)


class HealError(RuntimeError):
    """The bucket does not lead to the run's state; the message says where and why."""


@dataclass(frozen=True)
class HealReport:
    checkpoint: int | None  # the round of the checkpoint loaded; None: from the initial state
    mirror: str | None  # the mirror it came from; None: the run's store
    replayed: int  # rounds applied after it
    skipped: int  # sealed rounds not committed (too few contributors, or failed for all)
    step: int
    sync: int
    seconds: float

    def describe(self) -> str:
        source = (
            "the initial state" if self.checkpoint is None
            else f"checkpoint {self.checkpoint}"
            + ("" if self.mirror is None else f" of mirror {self.mirror}")
        )  # fmt: skip
        return (
            f"healed from {source}: replayed {self.replayed} rounds, skipped {self.skipped}; "
            f"at step {self.step}, joining round {self.sync} ({self.seconds:.1f}s)"
        )


def _load(checkpoint: Checkpoint, state: GlobalState, manager: BucketManager) -> bool:
    """Load ``checkpoint`` (its counters and fingerprint already checked against its COMMIT);
    False (logged) if it does not fit this replica's model and optimizers."""
    commit, tree = checkpoint.commit, checkpoint.tree
    try:
        state.load_fragments_tree(tree["fragments"])
        manager.load_state_dict(tree["manager"])
    except Exception as exc:  # another model or optimizer, or a malformed tree
        log.warning("checkpoint of round %d not used: it does not fit this replica's model and "
                    "optimizers: %s", commit.round, exc)  # fmt: skip
        return False
    found = fingerprint(commit.step, state.checksum())
    if found != commit.fingerprint:
        log.warning("checkpoint of round %d not used: loaded, it fingerprints as %s, its COMMIT "
                    "says %s", commit.round, found, commit.fingerprint)  # fmt: skip
        return False
    return True


def _replay(
    collective: BucketCollective, state: GlobalState, manager: BucketManager, min_replicas: int
) -> tuple[int, int]:
    """Apply every sealed round from the manager's next one on; (replayed, skipped)."""
    replayed = skipped = 0
    unreadable: list[str] = []  # rounds skipped because a sealed record did not read back
    fragments = len(state.fragments)
    while True:
        counters = manager.state_dict()
        round_ = counters["sync"]
        try:
            observed = collective.observe(round_)
        except RoundDataMissingError as exc:
            raise HealError(
                f"round {round_} cannot be replayed: its data is gone from the bucket ({exc}); "
                f"rounds after the oldest kept checkpoint must stay (checkpoint.keep)"
            ) from None
        except SealedContributionError as exc:  # every replica failed this round alike
            log.warning("round %d is not replayed: %s", round_, exc)
            unreadable.append(f"round {round_} was skipped as unreadable ({exc})")
            skipped += 1
            manager.load_state_dict({**counters, "sync": round_ + 1})
            continue
        except WireFormatError as exc:  # a SEAL or manifest of the round that does not parse
            raise HealError(f"round {round_} cannot be replayed: {exc}") from None
        if observed is None:
            return replayed, skipped
        result, mean = observed
        contributors = len(result.seal.contributors)
        if contributors >= min_replicas:
            step = counters["step"]
            mine = fingerprint(step, state.checksum())
            if mine != result.fingerprint:
                raise HealError(
                    f"round {round_} was sealed by replicas holding {result.fingerprint}; "
                    f"replayed to there, this replica holds {mine}. Replicas must build the "
                    f"same initial model (seed every random init with the task's seed) and run "
                    f"the same code on the same kind of device"
                    + "".join(
                        f"; or {skip}, which the other replicas applied: its data was damaged "
                        f"after it was sealed"
                        for skip in unreadable
                    )
                )
            try:
                state.replay(step % fragments, mean)
            except (ValueError, TypeError, RuntimeError) as exc:  # a mean unlike the model
                raise HealError(f"round {round_} does not apply to this model: {exc}") from None
            committed = counters["batches_committed"] + contributors
            counters = {**counters, "step": step + 1, "batches_committed": committed}
            replayed += 1
        else:
            skipped += 1
        manager.load_state_dict({**counters, "sync": round_ + 1})


def heal(
    collective: BucketCollective,
    state: GlobalState,
    manager: BucketManager,
    min_replicas: int,
    *,
    from_initial: bool,
    mirrors: Sequence[Store] = (),
) -> HealReport:
    """Bring ``state`` and ``manager`` to the run's newest sealed round, then set the local
    weights to the global ones. Checkpoints are tried newest first, from the store or from
    ``mirrors``, and an older one when a newer one does not load or does not replay to the
    sealed fingerprints. ``from_initial``: the state is still the task's initial one, usable
    when no checkpoint is committed yet (a fresh process)."""
    started, tried = time.perf_counter(), False
    checkpoints = newest_checkpoints(
        collective.store, collective.layout, mirrors, _sealed_after(collective)
    )
    for checkpoint in checkpoints:
        tried = True
        if not _load(checkpoint, state, manager):
            continue
        try:
            replayed, skipped = _replay(collective, state, manager, min_replicas)
        except HealError as exc:
            log.warning("healing from checkpoint %d failed: %s; trying the previous one",
                        checkpoint.commit.round, exc)  # fmt: skip
            continue
        mirror = checkpoint.source if checkpoint.from_mirror else None
        return _healed(state, manager, checkpoint.commit.round, mirror, replayed, skipped, started)
    if tried or not from_initial:
        raise HealError(
            "no committed checkpoint in the bucket heals this replica (see the warnings above), "
            "and it cannot replay from its initial state (it trained, or a checkpoint was "
            "loaded into it); the first checkpoint is written after the first committed round"
        )
    manager.load_state_dict({"step": 0, "batches_committed": 0, "sync": 0})
    replayed, skipped = _replay(collective, state, manager, min_replicas)
    return _healed(state, manager, None, None, replayed, skipped, started)


def _sealed_after(collective: BucketCollective) -> Confirm:
    """Refuses a mirror's checkpoint unless the run's store sealed the round after it from the
    state it holds."""

    def confirm(commit: CheckpointCommit) -> str | None:
        try:
            sealed = collective.sealed_fingerprint(commit.sync)
        except (SealedContributionError, WireFormatError) as exc:
            return f"round {commit.sync}, which would confirm it, does not read back: {exc}"
        except StoreError as exc:  # the run's store, not the mirror: healing cannot go on
            raise HealError(f"the run's store cannot be read: {exc}") from exc
        if sealed is None:
            return (
                f"the run's store has not sealed round {commit.sync}, which would confirm it "
                f"is this run's state"
            )
        if sealed != commit.fingerprint:
            return (
                f"round {commit.sync} was sealed from state {sealed}, not from this "
                f"checkpoint's {commit.fingerprint}: it is from an earlier run of the same name"
            )
        return None

    return confirm


def _healed(
    state: GlobalState,
    manager: BucketManager,
    checkpoint: int | None,
    mirror: str | None,
    replayed: int,
    skipped: int,
    started: float,
) -> HealReport:
    state.reset_local_weights()
    counters = manager.state_dict()
    return HealReport(
        checkpoint=checkpoint,
        mirror=mirror,
        replayed=replayed,
        skipped=skipped,
        step=counters["step"],
        sync=counters["sync"],
        seconds=time.perf_counter() - started,
    )
