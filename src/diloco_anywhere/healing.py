"""Healing: bring a replica's global state to the run's, with the bucket as the only source.

torchft heals a joining replica by sending it a peer's state over HTTP or the process group;
ours cannot reach each other. So a replica that starts while a run is going (new, restarted
after a crash, or relaunched after the whole run stopped), or whose state diverged from the
others', loads the newest committed checkpoint that reads back intact (``checkpoint.py``) and
replays every round sealed since, in order, through the outer optimizer (``global_state.py``).

Every step is checked. A loaded checkpoint must reproduce the fingerprint in its COMMIT, and
before each replayed round the replica's fingerprint must equal the one the round's
contributors sealed with, so a healed replica holds the others' global state bit for bit or
fails saying where it differs. Then it joins the first round that has no SEAL yet.

Rounds are replayed as every replica decides them: a round sealed with fewer than
``min_replicas`` contributors, or one whose sealed data cannot be read intact (every replica
failed it alike), is skipped; every other sealed round was committed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from diloco_anywhere.checkpoint import Checkpoint, newest_checkpoints
from diloco_anywhere.collective.allreduce import BucketCollective
from diloco_anywhere.collective.round import RoundDataMissingError, SealedContributionError
from diloco_anywhere.global_state import GlobalState, fingerprint
from diloco_anywhere.manager import BucketManager
from diloco_anywhere.wire import WireFormatError

log = logging.getLogger(__name__)


class HealError(RuntimeError):
    """The bucket does not lead to the run's state; the message says where and why."""


@dataclass(frozen=True)
class HealReport:
    checkpoint: int | None  # the round of the checkpoint loaded; None: from the initial state
    replayed: int  # rounds applied after it
    skipped: int  # sealed rounds not committed (too few contributors, or failed for all)
    step: int
    sync: int
    seconds: float

    def describe(self) -> str:
        source = "the initial state" if self.checkpoint is None else f"checkpoint {self.checkpoint}"
        return (
            f"healed from {source}: replayed {self.replayed} rounds, skipped {self.skipped}; "
            f"at step {self.step}, joining round {self.sync} ({self.seconds:.1f}s)"
        )


def _load(checkpoint: Checkpoint, state: GlobalState, manager: BucketManager) -> bool:
    """Load ``checkpoint``; False (logged) if it does not fit this replica or its COMMIT."""
    commit, tree = checkpoint.commit, checkpoint.tree
    counters = tree.get("manager") if isinstance(tree, dict) else None
    expected = {"step": commit.step, "sync": commit.sync}
    if not (
        isinstance(counters, dict)
        and {k: counters.get(k) for k in expected} == expected
        and type(counters.get("batches_committed")) is int
    ):
        log.warning("checkpoint of round %d not used: its counters %s are not its COMMIT's %s",
                    commit.round, counters, expected)  # fmt: skip
        return False
    try:
        state.load_fragments_tree(tree["fragments"])
        manager.load_state_dict(counters)
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
) -> HealReport:
    """Bring ``state`` and ``manager`` to the run's newest sealed round, then set the local
    weights to the global ones. Checkpoints are tried newest first, and an older one when a
    newer one does not load or does not replay to the sealed fingerprints. ``from_initial``:
    the state is still the task's initial one, usable when no checkpoint is committed yet (a
    fresh process)."""
    started, tried = time.perf_counter(), False
    for checkpoint in newest_checkpoints(collective.store, collective.layout):
        tried = True
        if not _load(checkpoint, state, manager):
            continue
        try:
            replayed, skipped = _replay(collective, state, manager, min_replicas)
        except HealError as exc:
            log.warning("healing from checkpoint %d failed: %s; trying the previous one",
                        checkpoint.commit.round, exc)  # fmt: skip
            continue
        return _healed(state, manager, checkpoint.commit.round, replayed, skipped, started)
    if tried or not from_initial:
        raise HealError(
            "no committed checkpoint in the bucket heals this replica (see the warnings above), "
            "and it cannot replay from its initial state (it trained, or a checkpoint was "
            "loaded into it); the first checkpoint is written after the first committed round"
        )
    manager.load_state_dict({"step": 0, "batches_committed": 0, "sync": 0})
    replayed, skipped = _replay(collective, state, manager, min_replicas)
    return _healed(state, manager, None, replayed, skipped, started)


def _healed(
    state: GlobalState,
    manager: BucketManager,
    checkpoint: int | None,
    replayed: int,
    skipped: int,
    started: float,
) -> HealReport:
    state.reset_local_weights()
    counters = manager.state_dict()
    return HealReport(
        checkpoint=checkpoint,
        replayed=replayed,
        skipped=skipped,
        step=counters["step"],
        sync=counters["sync"],
        seconds=time.perf_counter() - started,
    )
