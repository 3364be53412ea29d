"""Healing: bring a replica's global state to the run's, from its store and mirrors alone.

torchft heals a joining replica by sending it a peer's state over HTTP or the process group;
ours cannot reach each other. So a replica that starts while a run is going (new, restarted
after a crash, or relaunched after the whole run stopped), or whose state diverged from the
others', loads the newest committed checkpoint that reads back intact (``checkpoints/``) and
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
``min_replicas`` contributors, or one whose SEAL or sealed data cannot be read intact (every
replica failed it alike), is skipped; every other sealed round was committed.

A sharded replica (``sharding = "fsdp"``) heals every rank at once, each its own shard: from its
part of the checkpoint, replaying the rounds of its own exchange. Its ranks take every decision
together (``ReplicaGroup.gather``), as they do live: a checkpoint is used only if every rank's
part loads; a round is replayed only if every rank's round is sealed and committed, skipped if
any rank's was not committed, and healing stops at the first round some rank has no SEAL for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from diloco_anywhere.bucket.errors import StoreError
from diloco_anywhere.bucket.format.framing import WireFormatError
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.allreduce import BucketCollective
from diloco_anywhere.collective.errors import (
    ModelMismatchError,
    RoundDataMissingError,
    SealedContributionError,
)
from diloco_anywhere.training.checkpoints.catalogue import (
    checkpoint_holders,
    first_intact,
    newest_checkpoints,
)
from diloco_anywhere.training.checkpoints.records import (
    WHOLE,
    Checkpoint,
    CheckpointCommit,
    CheckpointError,
    Confirm,
    ShardOf,
)
from diloco_anywhere.training.managers.bucket import BucketManager
from diloco_anywhere.training.mistakes import ModelUnlikeRunError
from diloco_anywhere.training.ranks.replica_group import ReplicaGroup
from diloco_anywhere.training.state.fingerprints import fingerprint
from diloco_anywhere.training.state.global_state import GlobalState, local_tensor

ALONE = ReplicaGroup()

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


class _MisfitError(Exception):
    """A checkpoint that does not fit this replica's model and optimizers (its shapes, dtypes
    or names differ), why."""


def _load(checkpoint: Checkpoint, state: GlobalState, manager: BucketManager) -> bool:
    """Load ``checkpoint`` (its counters and fingerprint already checked against its COMMIT);
    False (logged) if it does not load as its COMMIT says; ``_MisfitError`` if it does not fit
    this replica's model and optimizers."""
    commit, tree = checkpoint.commit, checkpoint.tree
    try:
        state.load_fragments_tree(tree["fragments"])
        manager.load_state_dict(tree["manager"])
    except CheckpointError as exc:  # its bytes, read as they are loaded (a value not finite)
        log.warning("checkpoint of round %d not used: %s", commit.round, exc)
        return False
    except Exception as exc:  # another model or optimizer, or a malformed tree
        log.warning("checkpoint of round %d not used: it does not fit this replica's model and "
                    "optimizers: %s", commit.round, exc)  # fmt: skip
        raise _MisfitError(f"checkpoint {commit.round}: {exc}") from None
    found = fingerprint(commit.step, state.checksum())
    if found != checkpoint.fingerprint:
        log.warning("checkpoint of round %d not used: loaded, it fingerprints as %s, its COMMIT "
                    "says %s", commit.round, found, checkpoint.fingerprint)  # fmt: skip
        return False
    return True


def _loaded(checkpoint: Checkpoint | None, state: GlobalState, manager: BucketManager,
            misfits: list[str]) -> bool:  # fmt: skip
    """``_load``, a misfit's reason kept in ``misfits``."""
    if checkpoint is None:
        return False
    try:
        return _load(checkpoint, state, manager)
    except _MisfitError as misfit:
        misfits.append(str(misfit))
        return False


@dataclass(frozen=True)
class _Verdict:
    """What one rank found of a round: ``apply``, ``skip`` (too few contributors),
    ``unreadable`` (every replica failed it alike), ``open`` (no SEAL yet) or ``error``."""

    kind: str
    detail: str = ""
    contributors: int = 0  # in the SEAL of a round that applies


def _examine(
    collective: BucketCollective,
    state: GlobalState,
    counters: dict[str, int],
    min_replicas: int,
    unreadable: list[str],
) -> _Verdict:
    """This rank's verdict on the round the manager is at; its mean, when it applies, in the
    fragment's parameters (``GlobalState.replay``)."""
    round_ = counters["sync"]
    index = counters["step"] % len(state.fragments)
    numel = sum(local_tensor(p).numel() for p in state.fragments[index].parameters())
    try:  # the mean into the fragment's parameters: they hold nothing a heal needs
        observed = collective.observe(round_, numel, into=state.replay_buffers(index))
    except ModelMismatchError as exc:
        return _Verdict("error", str(exc))
    except RoundDataMissingError as exc:
        return _Verdict("error", f"round {round_} cannot be replayed: its data is gone from the "
                        f"bucket ({exc}); rounds after the oldest kept checkpoint must stay "
                        f"(checkpoint.keep)")  # fmt: skip
    except (SealedContributionError, WireFormatError) as exc:
        # its sealed data, or its SEAL itself (a field this release does not know, a checksum
        # that fails), does not read back: the live replicas failed the round on the same
        # bytes (``Round._load_seal``), and none committed it
        return _Verdict("unreadable", f"round {round_} was skipped as unreadable ({exc})")
    if observed is None:
        return _Verdict("open")
    result, _ = observed
    if len(result.seal.contributors) < min_replicas:
        return _Verdict("skip")
    mine = fingerprint(counters["step"], state.checksum())
    if mine != result.fingerprint:
        return _Verdict("error", (
            f"round {round_} was sealed by replicas holding {result.fingerprint}; replayed to "
            f"there, this replica holds {mine}. Replicas must build the same initial model "
            f"(seed every random init with the task's seed) and run the same code on the same "
            f"kind of device"
        ) + "".join(
            f"; or {skip}, which the other replicas applied: its data was damaged after it "
            f"was sealed"
            for skip in unreadable
        ))  # fmt: skip
    return _Verdict("apply", contributors=len(result.seal.contributors))


def _together(verdicts: list[_Verdict]) -> _Verdict:
    """The replica's verdict from its ranks': an error, else an open round, else a skip, else
    the round applies, counting the fewest replicas in any rank's SEAL (as the live sync did:
    ``ShardManager.num_participants``)."""
    for kind in ("error", "open", "unreadable", "skip"):
        found = [(rank, v) for rank, v in enumerate(verdicts) if v.kind == kind]
        if found:
            rank, verdict = found[0]
            detail = verdict.detail if len(verdicts) == 1 else f"rank {rank}: {verdict.detail}"
            return _Verdict(kind, detail)
    return _Verdict("apply", contributors=min(verdict.contributors for verdict in verdicts))


def _replay(
    collective: BucketCollective,
    state: GlobalState,
    manager: BucketManager,
    min_replicas: int,
    ranks: ReplicaGroup = ALONE,
) -> tuple[int, int]:
    """Apply every sealed round from the manager's next one on, as all ``ranks`` of the
    replica decide together; (replayed, skipped)."""
    replayed = skipped = 0
    unreadable: list[str] = []  # rounds skipped because a sealed record did not read back
    while True:
        counters = manager.state_dict()
        mine = _examine(collective, state, counters, min_replicas, unreadable)
        verdict = _together(ranks.gather(mine))
        if verdict.kind == "error":
            raise HealError(verdict.detail)
        if verdict.kind == "open":
            return replayed, skipped
        if verdict.kind in ("unreadable", "skip"):
            if verdict.kind == "unreadable":
                log.warning("%s", verdict.detail)
                unreadable.append(verdict.detail)
            skipped += 1
        else:  # errors after the agreement end the process: the ranks could no longer agree
            state.replay(counters["step"] % len(state.fragments))
            committed = counters["batches_committed"] + verdict.contributors
            counters = {**counters, "step": counters["step"] + 1, "batches_committed": committed}
            replayed += 1
        manager.load_state_dict({**counters, "sync": counters["sync"] + 1})


def _candidates(
    collective: BucketCollective,
    mirrors: Sequence[Store],
    shard: ShardOf,
    ranks: ReplicaGroup,
) -> Iterator[Checkpoint | None]:
    """Checkpoints to heal from, newest first, from the store or its mirrors. A sharded
    replica's ranks go through rank 0's list of committed rounds together, each loading its
    part (None where no copy of it loads)."""
    store, layout, confirm = collective.store, collective.layout, _sealed_after(collective, shard)
    if not shard.sharded:  # each value is checked as it is loaded, the fingerprint after
        yield from newest_checkpoints(store, layout, mirrors, confirm, shard, verify=False)
        return
    listed = checkpoint_holders(store, layout, mirrors) if ranks.is_leader else None
    for round_, holders in ranks.broadcast(listed):
        yield first_intact(store, mirrors, holders, layout, round_, confirm, shard, verify=False)


def heal(
    collective: BucketCollective,
    state: GlobalState,
    manager: BucketManager,
    min_replicas: int,
    *,
    from_initial: bool,
    mirrors: Sequence[Store] = (),
    shard: ShardOf = WHOLE,
    ranks: ReplicaGroup = ALONE,
) -> HealReport:
    """Bring ``state`` and ``manager`` to the run's newest sealed round, then set the local
    weights to the global ones. Checkpoints are tried newest first, from the store or from
    ``mirrors``, and an older one when a newer one does not load or does not replay to the
    sealed fingerprints. ``from_initial``: the state is still the task's initial one, usable
    when no checkpoint is committed yet (a fresh process). ``shard`` and ``ranks``: this
    process's part of a sharded replica, and the replica's ranks, which heal together."""
    started, tried, misfits = time.perf_counter(), False, []
    for checkpoint in _candidates(collective, mirrors, shard, ranks):
        try:
            loaded = _loaded(checkpoint, state, manager, misfits)
        finally:
            if checkpoint is not None:
                checkpoint.close()  # what was downloaded of it: its tensors are in the state
        found = ranks.gather((checkpoint is not None, loaded))  # every rank's
        tried |= any(intact for intact, _ in found)
        if not all(fits for _, fits in found):
            continue
        try:
            replayed, skipped = _replay(collective, state, manager, min_replicas, ranks)
        except HealError as exc:
            log.warning("healing from checkpoint %d failed: %s; trying the previous one",
                        checkpoint.commit.round, exc)  # type: ignore[union-attr]  # fmt: skip
            continue
        mirror = checkpoint.source if checkpoint.from_mirror else None  # type: ignore[union-attr]
        round_ = checkpoint.commit.round  # type: ignore[union-attr]
        return _healed(state, manager, round_, mirror, replayed, skipped, started)
    if misfits:
        raise ModelUnlikeRunError(
            f"this replica's model does not fit the run's checkpoints, which its replicas "
            f"trained ({misfits[0]}). Every replica must build the same model (class, config, "
            f"size, dtype) and the same outer optimizer; another tokenizer's vocabulary sizes "
            f"the embeddings otherwise"
        )
    if tried or not from_initial:
        raise HealError(
            "no committed checkpoint in the bucket heals this replica (see the warnings above), "
            "and it cannot replay from its initial state (it trained, or a checkpoint was "
            "loaded into it); the first checkpoint is written after the first committed round"
        )
    manager.load_state_dict({"step": 0, "batches_committed": 0, "sync": 0})
    replayed, skipped = _replay(collective, state, manager, min_replicas, ranks)
    return _healed(state, manager, None, None, replayed, skipped, started)


def _sealed_after(collective: BucketCollective, shard: ShardOf) -> Confirm:
    """Refuses a mirror's checkpoint unless the run's store sealed the round after it from the
    state it holds (this rank's part of it: each rank's exchange has its own rounds)."""

    def confirm(commit: CheckpointCommit) -> str | None:
        parts = commit.parts()
        held = parts[shard.rank].fingerprint if len(parts) == shard.ranks else commit.fingerprint
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
        if sealed != held:
            return (
                f"round {commit.sync} was sealed from state {sealed}, not from this "
                f"checkpoint's {held}: it is from an earlier run of the same name"
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
