"""Global checkpoints in the bucket: written in parallel, committed last, loaded only intact."""

from __future__ import annotations

import json
import logging
import re
import struct
from dataclasses import replace

import pytest
import torch
from crc32c import crc32c
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from diloco_anywhere.bucket.format.record import decode_record, encode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import RunConfig
from diloco_anywhere.training.checkpoints.catalogue import newest_checkpoints
from diloco_anywhere.training.checkpoints.commits import (
    committed_rounds,
    read_commit,
    retained_after,
)
from diloco_anywhere.training.checkpoints.reader import (
    load_checkpoint,
    materialized,
    read_checkpoint,
)
from diloco_anywhere.training.checkpoints.records import CheckpointCommit, CheckpointError, ShardOf
from diloco_anywhere.training.checkpoints.staging import HostStaging, write_part
from diloco_anywhere.training.checkpoints.tree import flatten, plan_shards, unflatten, whole_tree
from diloco_anywhere.training.checkpoints.writer import CheckpointPolicy, CheckpointWriter
from diloco_anywhere.training.recovery.mirrors import copy_checkpoint
from diloco_anywhere.training.state.fingerprints import fingerprint
from diloco_anywhere.training.state.global_state import LocalShard, tree_checksum
from support.checkpoints import (
    CONTRIBUTORS,
    RUN,
    counters_after,
    diloco_like_state,
    rewrite_counters,
    write_checkpoint,
)


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(str(tmp_path / "store"))


def assert_same_tree(found, expected) -> None:
    found_leaves = torch.utils._pytree.tree_leaves(found)
    expected_leaves = torch.utils._pytree.tree_leaves(expected)
    assert len(found_leaves) == len(expected_leaves)
    for a, b in zip(found_leaves, expected_leaves, strict=True):
        if isinstance(b, LocalShard):
            assert torch.equal(a.tensor, b.tensor)
            assert (a.shape, a.offset, a.mesh, a.placements) == (
                b.shape, b.offset, b.mesh, b.placements,
            )  # fmt: skip
        elif isinstance(b, torch.Tensor):
            assert torch.equal(a, b)
        else:
            assert a == b


def test_the_state_flattens_to_named_tensors_and_json_and_back() -> None:
    state = diloco_like_state()
    tensors, structure = flatten(state)
    assert (
        "['fragments']['StreamingDiLoCoFragment_0']['original_parameters']['0.weight']" in tensors
    )
    assert b"nesterov" in structure  # the optimizer's hyperparameters, as JSON
    assert_same_tree(unflatten(structure, tensors, "k"), state)
    with pytest.raises(CheckpointError, match="k: state structure does not parse: node 'tensor'"):
        unflatten(structure, dict(list(tensors.items())[1:]), "k")
    with pytest.raises(CheckpointError, match="k: the shards hold tensors the structure lacks"):
        unflatten(structure, {**tensors, "extra": torch.zeros(1)}, "k")


@pytest.mark.parametrize(
    "structure",
    [
        b'{"__enum__": {"fqn": "os:environ", "name": "HOME"}}',  # torch pytree's import hook
        b'{"dict": [["a", {"value": {"nested": 1}}]]}',  # a value that is not a scalar
        b'{"dict": [[true, {"value": 1}]]}',  # a bool key
        b"[" * 100_000,  # nesting deep enough to exhaust the parser's recursion
        b"not json",
    ],
)
def test_a_structure_from_the_bucket_never_chooses_what_runs(structure) -> None:
    """Bucket bytes are data: nothing in them imports, calls or looks anything up."""
    with pytest.raises(CheckpointError, match="k: state structure does not parse"):
        unflatten(structure, {}, "k")


def test_shards_split_the_bytes_evenly_in_order() -> None:
    tensors = {f"t{i}": torch.zeros(100) for i in range(9)}
    plan = plan_shards(tensors, 3)
    assert plan == [["t0", "t1", "t2"], ["t3", "t4", "t5"], ["t6", "t7", "t8"]]
    assert plan_shards(tensors, 20) == [[name] for name in tensors]  # never an empty shard


def test_contributors_write_shards_in_parallel_and_the_first_commits(backend) -> None:
    """On every store (S3, Azure and GCS through their stand-ins)."""
    store = backend.store()
    state = diloco_like_state(round_=7)
    write_checkpoint(store, 7, state)
    assert committed_rounds(store, RUN) == [7]
    checkpoint = load_checkpoint(store, RUN, 7)
    assert_same_tree(checkpoint.tree, state)
    commit = checkpoint.commit
    assert (commit.round, commit.step, commit.sync) == (7, 8, 8)
    assert commit.fingerprint == fingerprint(8, tree_checksum(state["fragments"]))
    assert len(commit.shards) == 3
    # The shards are plain safetensors files: the run's weights are the user's to take.
    first = load_safetensors(store.get(commit.shards[0].key))
    assert all(isinstance(tensor, torch.Tensor) for tensor in first.values())


def test_the_committer_writes_the_shard_of_a_writer_that_died(store, caplog) -> None:
    caplog.set_level(logging.WARNING)
    state = diloco_like_state()
    write_checkpoint(store, 3, state, writers=("a-0", "b-0"), grace=0.3)  # c-0 never writes
    assert_same_tree(load_checkpoint(store, RUN, 3).tree, state)
    assert "in place of a late writer" in caplog.text


def test_a_writer_whose_state_differs_leaves_no_committed_checkpoint(store, caplog) -> None:
    """The committer reads the others' shards back: a diverged writer's bytes stop the COMMIT,
    so no reader ever meets a committed checkpoint that fails its checksums."""
    caplog.set_level(logging.WARNING)
    write_checkpoint(store, 3, diloco_like_state(0), trees={"b-0": diloco_like_state(1)})
    assert committed_rounds(store, RUN) == []
    assert "its writer stored other bytes than this replica's state" in caplog.text


def test_replicas_that_commit_the_same_checkpoint_alone_agree(store, caplog) -> None:
    """Replicas joining together each write their first checkpoint alone: the COMMITs differ in
    their time only, and the second writer finds the first's and leaves it."""
    caplog.set_level(logging.INFO)
    state = diloco_like_state(round_=5)
    for name in CONTRIBUTORS[:2]:
        writer = CheckpointWriter(store, RUN, name, CheckpointPolicy.of(RunConfig(), poll=0.02))
        writer.write(5, (name,), state, last=True)
        writer.close()
    assert "checkpoint of round 5 was committed by another replica" in caplog.text
    assert "not written" not in caplog.text
    assert_same_tree(load_checkpoint(store, RUN, 5).tree, state)


def test_the_runs_last_checkpoint_is_committed_though_its_first_contributor_died(store) -> None:
    """The run ends on its last COMMIT (``keeper.run_done``): every contributor commits that
    one, so a committer killed while writing it (an attempt's time limit) leaves it to the
    others; the first COMMIT stands and the others find it and agree."""
    state = diloco_like_state(round_=6)
    write_checkpoint(store, 6, state, writers=("b-0", "c-0"), grace=0.3, last=True)
    assert committed_rounds(store, RUN) == [6]
    checkpoint = load_checkpoint(store, RUN, 6)
    assert len(checkpoint.commit.shards) == len(CONTRIBUTORS)  # a-0's shard written for it
    assert_same_tree(checkpoint.tree, state)


def test_a_replica_outside_the_seal_commits_a_last_checkpoint_its_writers_left(store) -> None:
    """A replica that healed to the end (``write_last_if_missing``) plans the shards as the
    SEAL's contributors did: the shards they stored are its bytes too, the rest it writes."""
    state = diloco_like_state(round_=6)
    write_checkpoint(store, 6, state, writers=("b-0",))  # then b-0, and the others, died
    writer = CheckpointWriter(
        store, RUN, "d-0", CheckpointPolicy.of(RunConfig(), orphan_grace=0.3, poll=0.02)
    )
    assert writer.write(6, CONTRIBUTORS, state | {"manager": counters_after(6)}, last=True)
    writer.close()
    assert writer.committed(6)
    checkpoint = load_checkpoint(store, RUN, 6)
    assert [entry.key for entry in checkpoint.commit.shards] == [
        RUN.checkpoint_shard(6, s) for s in range(len(CONTRIBUTORS))
    ]
    assert_same_tree(checkpoint.tree, state)


def test_a_last_checkpoint_that_cannot_be_written_is_raised_not_logged(store) -> None:
    """A lost checkpoint is logged and training goes on; a lost last one would leave replicas
    that say done on a run that never ends: the replica that wrote it fails, naming why."""
    with pytest.raises(CheckpointError, match=r"the run's last checkpoint \(round 3\) was not "
                       r"written: .*its writer stored other bytes"):  # fmt: skip
        write_checkpoint(store, 3, diloco_like_state(0), trees={"b-0": diloco_like_state(1)},
                         last=True)  # fmt: skip
    assert committed_rounds(store, RUN) == []


def test_a_replica_outside_the_seal_writes_no_checkpoint_but_the_last(store) -> None:
    """A round's checkpoint is its SEAL's contributors' to write (a replica that healed into
    the round, or was left out of it, holds the same state but writes nothing of it); the
    run's last one is everyone's (``write_last_if_missing``, tested above)."""
    writer = CheckpointWriter(store, RUN, "d-0", CheckpointPolicy.of(RunConfig(), poll=0.02))
    state = diloco_like_state() | {"manager": counters_after(3)}
    assert not writer.write(3, CONTRIBUTORS, state, last=False)
    writer.close()
    assert store.list_prefix(RUN.checkpoint(3)) == []


def test_a_checkpoint_due_while_the_previous_one_is_written_is_skipped_saying_why(
    store, caplog
) -> None:
    """Checkpoints are written beside training, one at a time: one due while the previous is
    still being written (here the committer waits out its grace for two writers that never
    write) is skipped with the setting to raise, not queued behind it."""
    caplog.set_level(logging.WARNING)
    state = diloco_like_state()
    writer = CheckpointWriter(
        store, RUN, "a-0", CheckpointPolicy.of(RunConfig(), orphan_grace=1.0, poll=0.02)
    )
    assert writer.write(3, CONTRIBUTORS, state | {"manager": counters_after(3)}, last=False)
    assert not writer.write(4, CONTRIBUTORS, state | {"manager": counters_after(4)}, last=False)
    writer.close()
    assert "checkpoint of round 4 skipped: the previous one is still being written" in caplog.text
    assert "(raise checkpoint.every)" in caplog.text
    assert committed_rounds(store, RUN) == [3]


def test_a_checkpoint_without_commit_does_not_exist(store) -> None:
    write_checkpoint(store, 3, diloco_like_state(0))
    write_checkpoint(store, 6, diloco_like_state(1), writers=("b-0", "c-0"))  # the committer died
    assert RUN.checkpoint_shard(6, 1) in store.list_prefix(RUN.checkpoint(6))
    assert committed_rounds(store, RUN) == [3]
    assert [c.commit.round for c in newest_checkpoints(store, RUN)] == [3]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "state"])
def test_a_damaged_checkpoint_is_never_loaded_and_the_previous_one_is_used(
    store, caplog, damage
) -> None:
    caplog.set_level(logging.WARNING)
    older, newer = diloco_like_state(0), diloco_like_state(1)
    write_checkpoint(store, 3, older)
    write_checkpoint(store, 6, newer)
    commit = load_checkpoint(store, RUN, 6).commit
    key = commit.state.key if damage == "state" else commit.shards[1].key
    data = bytearray(store.get(key))
    store.delete(key)
    if damage in ("flip", "state"):
        data[len(data) // 2] ^= 0x01
    if damage != "delete":
        store.put(key, bytes(data[:-1] if damage == "truncate" else data))
    with pytest.raises(CheckpointError, match=key):
        load_checkpoint(store, RUN, 6)
    [used] = list(newest_checkpoints(store, RUN))[:1]
    assert used.commit.round == 3
    assert_same_tree(materialized(used.tree), older)
    used.close()
    assert f"checkpoint of round 6 not used: {key}" in caplog.text


def test_old_checkpoints_are_pruned_and_the_rounds_healing_needs_are_kept(store) -> None:
    assert retained_after(store, RUN, keep=2) == -1  # nothing committed: keep every round
    for round_ in (2, 5, 8):
        write_checkpoint(store, round_, diloco_like_state(round_))
    assert committed_rounds(store, RUN) == [8, 5]
    assert not store.list_prefix(RUN.checkpoint(2))
    # healing may fall back to round 5's checkpoint and replay the rounds after it
    assert retained_after(store, RUN, keep=2) == 5


def test_a_copy_is_the_checkpoint_and_replaces_what_another_run_left_in_its_round(
    store, tmp_path, caplog
) -> None:
    """The same checkpoint copied again is a no-op; a folder holding another run's checkpoint
    of that round, or a copy cut short, is replaced (a create-only put would refuse it)."""
    caplog.set_level(logging.WARNING)
    write_checkpoint(store, 3, diloco_like_state(0))
    ours = read_checkpoint(store, RUN, 3)
    mirror = Store(str(tmp_path / "mirror"))
    copy_checkpoint(mirror, RUN, ours)
    copy_checkpoint(mirror, RUN, ours)
    assert read_checkpoint(mirror, RUN, 3).commit_bytes == ours.commit_bytes  # read back whole
    assert "replaced" not in caplog.text

    other = Store(str(tmp_path / "other"))  # an earlier run of the same name
    write_checkpoint(other, 3, diloco_like_state(1))
    stale = Store(str(tmp_path / "stale"))
    copy_checkpoint(stale, RUN, read_checkpoint(other, RUN, 3))
    copy_checkpoint(stale, RUN, ours)
    assert read_checkpoint(stale, RUN, 3).commit_bytes == ours.commit_bytes
    assert f"replaced {len(ours.objects) + 1} objects under {RUN.checkpoint(3)}" in caplog.text

    cut_short = Store(str(tmp_path / "cut-short"))
    cut_short.put(ours.commit.shards[0].key, b"the first bytes of a shard")
    copy_checkpoint(cut_short, RUN, ours)
    assert read_checkpoint(cut_short, RUN, 3).commit_bytes == ours.commit_bytes


def test_pruning_counts_from_the_round_written_not_from_later_rounds_of_another_run(
    store, tmp_path
) -> None:
    """A mirror holding round 9 of an earlier run of the same name keeps this run's newest
    checkpoints up to the round written, not round 9 and one other."""
    for round_ in (2, 5, 8, 9):
        write_checkpoint(store, round_, diloco_like_state(round_))
    mirror = Store(str(tmp_path / "mirror"))
    copy_checkpoint(mirror, RUN, read_checkpoint(store, RUN, 9))
    for round_ in (2, 5, 8):  # the writer prunes after each commit, keeping 2
        write_checkpoint(mirror, round_, diloco_like_state(round_))
    assert committed_rounds(mirror, RUN) == [9, 8, 5]


@pytest.mark.parametrize("bad_key", ["run/checkpoints/0000000003/..", "run/members/a/0/claim"])
def test_a_commit_naming_keys_outside_its_checkpoint_is_not_loaded(store, bad_key) -> None:
    write_checkpoint(store, 3, diloco_like_state())
    key = RUN.checkpoint_commit(3)
    commit = decode_record(store.get(key), CheckpointCommit, key=key)
    shard = commit.shards[0].model_copy(update={"key": bad_key})
    store.delete(key)
    store.put(key, encode_record(commit.model_copy(update={"shards": (shard,)})))
    with pytest.raises(CheckpointError, match=f"{key}: "):
        load_checkpoint(store, RUN, 3)
    assert list(newest_checkpoints(store, RUN)) == []


def _crafted_safetensors(dtype: str, nbytes: int) -> bytes:
    header = json.dumps({"t": {"dtype": dtype, "shape": [1], "data_offsets": [0, nbytes]}})
    return struct.pack("<Q", len(header)) + header.encode() + b"\x01" * nbytes


def assert_falls_back(store: Store, caplog, key: str, said: str) -> None:
    """Round 6's checkpoint is refused with a ``CheckpointError`` naming ``key`` and saying
    ``said``, and round 3's is used in its place, the refusal logged."""
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(store, RUN, 6)
    assert str(refused.value).startswith(f"{key}: ")
    assert said in str(refused.value)
    [used] = list(newest_checkpoints(store, RUN))[:1]
    assert used.commit.round == 3
    assert f"checkpoint of round 6 not used: {key}: " in caplog.text


COMMIT_DEFECTS = {
    "a counter out of range": {"round": 2**64},
    "an object named twice": {"shards": "twice"},
    "a fingerprint of another step": {"fingerprint": "step-99-0000abcd"},
    "a commit time past year 9999": {"time": 1e300},
}


@pytest.mark.parametrize(
    "defect", ["a dtype torch lacks", "a shard size no file has", *COMMIT_DEFECTS]
)
def test_any_defect_of_a_checkpoint_falls_back_to_the_previous_one(store, caplog, defect) -> None:
    """A COMMIT that checks out (its CRCs match what it names) can still name bytes that are
    no checkpoint: healing falls back, naming the key and why, never an exception."""
    caplog.set_level(logging.WARNING)
    write_checkpoint(store, 3, diloco_like_state(0))
    write_checkpoint(store, 6, diloco_like_state(1))
    commit_key = RUN.checkpoint_commit(6)
    commit = load_checkpoint(store, RUN, 6).commit
    entry = commit.shards[1]
    if defect == "a dtype torch lacks":  # safetensors knows F8_E8M0, this torch does not
        data = _crafted_safetensors("F8_E8M0", 1)
        store.delete(entry.key)
        store.put(entry.key, data)
        entry = entry.model_copy(update={"size": len(data), "crc32c": crc32c(data)})
        commit = commit.model_copy(update={"shards": (commit.shards[0], entry, *commit.shards[2:])})
    elif defect == "a shard size no file has":
        entry = entry.model_copy(update={"size": 2**62})
        commit = commit.model_copy(update={"shards": (commit.shards[0], entry, *commit.shards[2:])})
    else:
        fields = COMMIT_DEFECTS[defect]
        if fields.get("shards") == "twice":
            fields = {"shards": (*commit.shards, commit.shards[0])}
        commit = commit.model_construct(**{**dict(commit), **fields})
    store.delete(commit_key)
    store.put(commit_key, encode_record(commit))
    assert_falls_back(store, caplog, commit_key if defect in COMMIT_DEFECTS else entry.key, "")


@pytest.mark.parametrize(
    ("counters", "where", "said"),
    [
        ({"sync": 10**10}, "COMMIT", "field sync: Input should be less than or equal to"),
        ({"sync": 6}, "COMMIT", "sync 6 must be round + 1 = 7"),
        ({"sync": 8}, "COMMIT", "sync 8 must be round + 1 = 7"),
        ({"step": 8}, "COMMIT", "step 8 must be at most sync 7"),
        ({"step": 2**63}, "COMMIT", "field step: Input should be less than or equal to"),
        ({"step": True}, "COMMIT", "field step: Input should be a valid integer"),
        ({"batches_committed": -1}, "state", "batches_committed is -1; allowed: an integer"),
        ({"batches_committed": 2**64}, "state", f"batches_committed is {2**64}; allowed"),
        ({"batches_committed": 14.0}, "state", "batches_committed is 14.0; allowed"),
        ({"batches_committed": True}, "state", "batches_committed is True; allowed"),
        ({"batches_committed": 6}, "state", "batches_committed is 6; allowed: at least step, 7"),
        ({"batches_committed": None}, "state", "counters step, batches_committed, sync"),
        ({"epoch": 1}, "state", "counters step, batches_committed, sync"),
    ],
)
def test_counters_that_no_manager_holds_are_damage_naming_the_counter(
    store, caplog, counters, where, said
) -> None:
    """Counters the state and its COMMIT agree on, out of range or unlike any the manager
    keeps (round 6's checkpoint holds step 7, sync 7): the checkpoint is refused naming its
    key and the counter, and the previous one is used. Before, sync 10**10 loaded, and
    healing then raised a ValueError building the key of round 10**10."""
    caplog.set_level(logging.WARNING)
    write_checkpoint(store, 3, diloco_like_state(0))
    write_checkpoint(store, 6, diloco_like_state(1))
    rewrite_counters(store, RUN, 6, **counters)
    key = RUN.checkpoint_commit(6) if where == "COMMIT" else RUN.checkpoint_state(6)
    assert_falls_back(store, caplog, key, said)


WEIGHTS = "['fragments']['StreamingDiLoCoFragment_0']['original_parameters']"
OUTER = "['fragments']['StreamingDiLoCoFragment_0']['outer_optimizer']"


def _fragment(tree: dict) -> dict:
    return tree["fragments"]["StreamingDiLoCoFragment_0"]


@pytest.mark.parametrize(
    ("damage", "tensor"),
    [
        (lambda t: _fragment(t)["original_parameters"]["0.weight"][2, 3].fill_(torch.nan),
         f"{WEIGHTS}['0.weight']"),
        (lambda t: _fragment(t)["outer_optimizer"]["state"][1]["momentum_buffer"][0].fill_(
            torch.inf), f"{OUTER}['state'][1]['momentum_buffer']"),
        (lambda t: _fragment(t)["original_parameters"].update(
            {"1.bias": torch.full((4,), -torch.inf, dtype=torch.bfloat16)}),
         f"{WEIGHTS}['1.bias']"),
        (lambda t: _fragment(t)["original_parameters"].update(
            {"1.bias": torch.full((4,), torch.nan).to(torch.float8_e4m3fn)}),
         f"{WEIGHTS}['1.bias']"),
    ],
    ids=["nan weight", "inf momentum", "-inf bfloat16 weight", "nan float8 weight"],
)  # fmt: skip
def test_a_tensor_value_that_is_not_finite_is_damage_naming_it(store, caplog, damage, tensor):
    """NaN or inf in the global weights or the outer momentum, written by the real writer: its
    CRC32Cs and fingerprint agree with its bytes. No run holds such a state (every replica
    refuses a mean that is not finite), so the checkpoint is damaged: refused naming its
    shard's key and the tensor, and the previous one used."""
    caplog.set_level(logging.WARNING)
    write_checkpoint(store, 3, diloco_like_state(0))
    newer = diloco_like_state(1)
    damage(newer)
    write_checkpoint(store, 6, newer)
    commit = read_commit(store, RUN, 6)[0]
    [key] = [e.key for e in commit.shards if tensor in load_safetensors(store.get(e.key))]
    assert_falls_back(store, caplog, key, f"tensor {tensor} holds ")


@pytest.mark.parametrize("value", [torch.nan, torch.inf, -torch.inf])
def test_a_number_in_the_structure_that_is_not_finite_is_damage(store, caplog, value) -> None:
    """The state's JSON (the optimizer's hyperparameters): ``json`` writes and reads NaN and
    Infinity; a reader refuses them."""
    caplog.set_level(logging.WARNING)
    write_checkpoint(store, 3, diloco_like_state(0))
    newer = diloco_like_state(1)
    _fragment(newer)["outer_optimizer"]["param_groups"][0]["lr"] = value
    write_checkpoint(store, 6, newer)
    assert_falls_back(store, caplog, RUN.checkpoint_state(6), "is not finite")


def test_a_commit_key_past_the_last_round_names_no_checkpoint(store) -> None:
    """A round of 11 digits has no key this code can build: listing and pruning pass it over
    (before, loading it raised a ValueError out of healing)."""
    write_checkpoint(store, 3, diloco_like_state(0))
    store.put(f"{RUN.checkpoints()}/{10**10}/COMMIT", encode_record(read_commit(store, RUN, 3)[0]))
    assert committed_rounds(store, RUN) == [3]
    assert [c.commit.round for c in newest_checkpoints(store, RUN)] == [3]
    for round_ in (5, 8):  # each commit prunes
        write_checkpoint(store, round_, diloco_like_state(round_))
    assert committed_rounds(store, RUN) == [8, 5]


# -- a sharded replica's checkpoint: one part per rank --------------------------------------


def split_in_ranks(tree: dict, ranks: int) -> list[dict]:
    """``tree`` as each rank of a sharded replica holds it: every tensor of more than one
    row cut in ``ranks`` pieces along dim 0 (FSDP2's Shard(0)), as ``LocalShard``s."""

    def piece(rank: int):
        def cut(leaf):
            if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
                return leaf
            rows = torch.tensor_split(leaf, ranks)[rank]
            offset = sum(len(r) for r in torch.tensor_split(leaf, ranks)[:rank])
            at = (offset,) + (0,) * (leaf.dim() - 1)
            return LocalShard(rows.clone(), tuple(leaf.shape), at, (ranks,), ("Shard(dim=0)",))

        return torch.utils._pytree.tree_map(cut, tree)

    return [piece(rank) for rank in range(ranks)]


def part_fingerprints(parts: list[dict]) -> tuple[str, ...]:
    """What the ranks gather before writing: each part's fingerprint."""
    return tuple(fingerprint(p["manager"]["step"], tree_checksum(p["fragments"])) for p in parts)


def write_sharded(store: Store, round_: int, tree: dict, ranks: int = 2, wait: float = 30.0):
    """Every rank of replica ``a`` writes its part at once; rank 0 commits."""
    policy = CheckpointPolicy.of(RunConfig(), poll=0.01, part_wait=wait)
    writers = [
        CheckpointWriter(store, RUN, "a", policy, shard=ShardOf(rank, ranks))
        for rank in range(ranks)
    ]
    parts = split_in_ranks(tree, ranks)
    for writer, part in zip(writers, parts, strict=True):
        assert writer.write(round_, ("a",), part, last=False, parts=part_fingerprints(parts))
    for writer in writers:
        writer.close()


def test_a_sharded_checkpoint_is_one_commit_over_every_ranks_part(store) -> None:
    tree = diloco_like_state()
    write_sharded(store, 3, tree)
    commit = read_commit(store, RUN, 3)[0]
    assert [len(part.shards) for part in commit.ranks] == [1, 1]
    assert {e.key.rsplit("/", 2)[1] for e in commit.entries()} == {"rank-0000", "rank-0001"}

    whole = load_checkpoint(store, RUN, 3)  # what export reads: the parts put together
    assert_same_tree(whole.tree, tree)
    assert whole.fingerprint == commit.fingerprint

    for rank, expected in enumerate(split_in_ranks(tree, 2)):  # what each rank heals from
        part = load_checkpoint(store, RUN, 3, shard=ShardOf(rank, 2))
        assert_same_tree(part.tree, expected)
        assert part.fingerprint == commit.ranks[rank].fingerprint
        shard = part.tree["fragments"]["StreamingDiLoCoFragment_0"]["original_parameters"][
            "0.weight"
        ]
        assert (shard.offset, shard.shape, shard.placements) == (
            (16 * rank, 0), (32, 16), ("Shard(dim=0)",),
        )  # fmt: skip


@pytest.mark.parametrize(
    ("reader", "expected"),
    [
        (ShardOf(0, 4), "sharded over 2 ranks; this replica is sharded over 4 ranks."),
        (ShardOf(), "sharded over 2 ranks; this replica is unsharded."),
    ],
)
def test_a_replica_of_another_rank_count_is_refused_a_sharded_checkpoint(
    store, reader, expected
) -> None:
    write_sharded(store, 3, diloco_like_state())
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(store, RUN, 3, shard=reader)
    assert f"run/checkpoints/0000000003/COMMIT: the checkpoint is {expected}" in str(refused.value)


def test_a_damaged_part_fails_its_rank_and_the_whole_but_not_the_others(store) -> None:
    write_sharded(store, 3, diloco_like_state())
    key = read_commit(store, RUN, 3)[0].ranks[1].shards[0].key
    data = bytearray(store.get(key))
    data[-1] ^= 1
    store.delete_prefix(key)
    store.put(key, bytes(data))
    for shard in (ShardOf(1, 2), None):
        with pytest.raises(CheckpointError, match=f"{key}: .* bytes with CRC32C"):
            load_checkpoint(store, RUN, 3, shard=shard)
    load_checkpoint(store, RUN, 3, shard=ShardOf(0, 2))  # healing agrees across the ranks


def test_rank_0_commits_nothing_when_another_rank_never_writes_its_part(store, caplog) -> None:
    policy = CheckpointPolicy.of(RunConfig(), poll=0.01, part_wait=0.2)
    writer = CheckpointWriter(store, RUN, "a", policy, shard=ShardOf(0, 2))
    parts = split_in_ranks(diloco_like_state(), 2)
    writer.write(3, ("a",), parts[0], last=False, parts=part_fingerprints(parts))
    writer.close()
    assert committed_rounds(store, RUN) == []
    assert "run/checkpoints/0000000003/rank-0001/PART: not written after 0.2s" in caplog.text


def test_rank_0_never_commits_a_part_of_another_state(store, caplog) -> None:
    """Another replica's rank 1 wrote this round's part first, from another state (its own
    first checkpoint, say): rank 0 refuses it at once rather than mix the two states."""
    policy = CheckpointPolicy.of(RunConfig(), poll=0.01, part_wait=30.0)
    theirs = split_in_ranks(diloco_like_state(seed=1), 2)
    other = CheckpointWriter(store, RUN, "b", policy, shard=ShardOf(1, 2))
    other.write(3, ("b",), theirs[1], last=False)
    other.close()
    ours = split_in_ranks(diloco_like_state(), 2)
    writer = CheckpointWriter(store, RUN, "a", policy, shard=ShardOf(0, 2))
    writer.write(3, ("a",), ours[0], last=False, parts=part_fingerprints(ours))
    writer.close()
    assert committed_rounds(store, RUN) == []
    assert "rank-0001/PART: another part than this replica's rank wrote" in caplog.text


def test_rank_0_commits_nothing_over_a_part_record_it_cannot_read(store, caplog) -> None:
    """A PART record that is not one (cut short, or another tool's file) stops the commit
    with its key named, as a part of another state does."""
    caplog.set_level(logging.WARNING)
    key = RUN.checkpoint_rank_done(3, 1)
    store.put(key, b"not a record")
    policy = CheckpointPolicy.of(RunConfig(), poll=0.01, part_wait=30.0)
    ours = split_in_ranks(diloco_like_state(), 2)
    writer = CheckpointWriter(store, RUN, "a", policy, shard=ShardOf(0, 2))
    writer.write(3, ("a",), ours[0], last=False, parts=part_fingerprints(ours))
    writer.close()
    assert committed_rounds(store, RUN) == []
    assert f"checkpoint of round 3 not written: {key}" in caplog.text


def test_a_one_rank_fsdp_checkpoint_loads_whole_and_an_unsharded_commit_is_as_before(store):
    """One rank's DTensors are checkpointed as shards covering the whole (a one-process FSDP
    replica); export reads plain tensors. Its COMMIT carries no ``ranks``: older releases
    read it."""
    tree = diloco_like_state()
    writer = CheckpointWriter(
        store, RUN, "a", CheckpointPolicy.of(RunConfig()), shard=ShardOf(0, 1)
    )
    writer.write(3, ("a",), split_in_ranks(tree, 1)[0], last=False)
    writer.close()
    assert_same_tree(load_checkpoint(store, RUN, 3).tree, tree)
    assert b'"ranks"' not in read_commit(store, RUN, 3)[1]


@pytest.mark.parametrize(
    ("mesh", "placements", "said"),
    [
        ((2,), ("Shard(dim=0)",), "a tensor is sharded over a mesh of [2]; the checkpoint has 1"),
        ((1, 1), ("Shard(dim=0)",), "one per dimension of the mesh"),
        ((0,), ("Shard(dim=0)",), "whose sizes are at least 1"),
    ],
)
def test_a_part_placed_on_a_mesh_unlike_its_checkpoints_ranks_is_damage(
    store, mesh, placements, said
) -> None:
    """A one-rank FSDP replica's part whose shards say they sit on another mesh: never put
    together or healed from."""
    part = split_in_ranks(diloco_like_state(), 1)[0]
    placed = torch.utils._pytree.tree_map(
        lambda leaf: replace(leaf, mesh=mesh, placements=placements)
        if isinstance(leaf, LocalShard) else leaf,
        part,
    )  # fmt: skip
    writer = CheckpointWriter(
        store, RUN, "a", CheckpointPolicy.of(RunConfig()), shard=ShardOf(0, 1)
    )
    writer.write(3, ("a",), placed, last=False)
    writer.close()
    for shard in (ShardOf(0, 1), None):
        with pytest.raises(CheckpointError, match=re.escape(said)):
            load_checkpoint(store, RUN, 3, shard=shard)


@pytest.mark.parametrize(
    ("offsets", "expected"),
    [((0, 16), None), ((0, 8), "overlap"), ((0,), "hold 16 elements, not 32")],
)
def test_a_sharded_tensor_is_put_together_only_from_shards_that_tile_it(offsets, expected) -> None:
    """Every element exactly once: shards that overlap (and leave a gap), or too few, are
    refused, before the whole tensor is allocated."""
    rows = torch.arange(32.0).view(32, 1)
    parts = [
        {"w": LocalShard(rows[16 * k : 16 * (k + 1)], (32, 1), (at, 0), (2,), ("Shard(dim=0)",))}
        for k, at in enumerate(offsets)
    ]
    if expected is None:
        assert torch.equal(whole_tree(parts)["w"].load(), rows)
    else:
        with pytest.raises(CheckpointError, match=expected):
            whole_tree(parts)


def test_the_state_is_written_as_it_was_when_released_though_training_changes_it_after(store):
    """No copy of the state: the writer reads it in place until its shards are on local disk
    (``release``, what the outer step waits for), then only uploads. What the outer step
    changes after that is not in the checkpoint; and shards are about ``part_bytes`` each."""
    tree = diloco_like_state(0) | {"manager": counters_after(3)}
    weights = tree["fragments"]["StreamingDiLoCoFragment_0"]["original_parameters"]
    before = {name: tensor.clone() for name, tensor in weights.items()}
    policy = CheckpointPolicy.of(RunConfig(), orphan_grace=1.0, poll=0.02, part_bytes=1024)
    writer = CheckpointWriter(store, RUN, "local-0", policy)
    assert writer.write(3, ("local-0",), tree, last=False)
    writer.release()
    for tensor in weights.values():  # the outer step of the next round
        tensor.add_(1.0)
    writer.close()
    written = load_checkpoint(store, RUN, 3)
    loaded = written.tree["fragments"]["StreamingDiLoCoFragment_0"]["original_parameters"]
    assert all(torch.equal(loaded[name], before[name]) for name in before)
    sizes = [entry.size for entry in written.commit.shards]
    assert len(sizes) == 4  # 3.5 KiB of tensors in parts of 1 KiB: every tensor whole
    assert max(sizes) < 4096


def test_a_shard_is_written_by_safetensors_itself_from_the_tensors_memory(tmp_path):
    """``write_part`` is safetensors' ``save_file`` over the tensors as they are (host ones
    not copied): the bytes ``save`` gives, which any safetensors reader loads."""
    tensors = {"a": torch.arange(12.0).view(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)}
    path = tmp_path / "part"
    staging = HostStaging()
    assert staging.host(tensors)["a"].data_ptr() == tensors["a"].data_ptr()  # no copy
    write_part(tensors, str(path), staging)
    assert path.read_bytes() == save_safetensors(tensors)
