"""A replica's own state (inner optimizer, random generators, local weights): saved under its
id, read back checked, and put back bit for bit when the replica restarts.

In this process: round trips through a real store, and every way a saved state is refused.
Across processes (``integration``): a two-replica run in which one replica dies right after a
checkpoint step and restarts ends with the same global weights and losses as the run without
the death, and without its saved state it does not.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import diloco_anywhere
from diloco_anywhere import BucketManager, Collective
from diloco_anywhere.bench.tools.processes import worker_context
from diloco_anywhere.bucket.feedback import ErrorFeedback
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import RunConfig, load_config
from diloco_anywhere.training.checkpoints.commits import committed_rounds, read_commit
from diloco_anywhere.training.checkpoints.objects import Spools
from diloco_anywhere.training.checkpoints.records import CheckpointError, ReplicaStateCommit
from diloco_anywhere.training.checkpoints.replica_states import (
    KEEP,
    read_replica_state,
    save_replica_state,
    saved_rounds,
)
from diloco_anywhere.training.records.metrics import MetricsReader
from diloco_anywhere.training.recovery.own_state import OwnState, load_own_state, own_tree
from support.checkpoints import record_bytes

LAYOUT = RunLayout("own")
REPLICA = "local-1"


def small_model(seed: int = 0, width: int = 16) -> nn.Module:
    """Dropout (torch's generator) and a norm's running statistics (a buffer DiLoCo never
    syncs)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.2), nn.Linear(width, 1)
    )


def train_a_little(model: nn.Module, inner: torch.optim.Optimizer, steps: int = 3) -> None:
    for _ in range(steps):
        x = torch.randn(16, 8)
        nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        inner.step()
        inner.zero_grad()


def draws() -> tuple:
    """A number from each generator a training script may draw from."""
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def saved(store: Store, model: nn.Module, inner, round_: int = 3, *, with_weights: bool = True):
    """Save ``model`` and ``inner``'s state as ``REPLICA``'s of ``round_``; the draws right
    after, which a restore must reproduce."""
    save_replica_state(store, LAYOUT, REPLICA, round_, round_ + 1,
                        own_tree(model, inner, with_weights))  # fmt: skip
    return draws()


def restored(store: Store, round_: int = 3, *, exact: bool = True, width: int = 16):
    """A fresh model and AdamW of another seed, the generators moved on, then the saved state
    of ``round_`` loaded into them."""
    model = small_model(seed=7, width=width)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    draws()
    key = LAYOUT.replica_state_commit(REPLICA, round_)
    _, tree = read_replica_state(store, LAYOUT, REPLICA, round_, 1 << 30, Spools())
    load_own_state(key, tree, model, inner, with_weights=True, exact=exact)
    return model, inner


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(f"file://{tmp_path}/store")


@pytest.fixture
def trained():
    model = small_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_a_little(model, inner)
    return model, inner


def test_a_saved_state_restores_moments_step_counts_weights_and_random_streams(store, trained):
    model, inner = trained
    after_save = saved(store, model, inner)
    again, optimizer = restored(store)
    assert draws() == after_save  # every generator goes on from where it was saved
    for number, state in inner.state_dict()["state"].items():
        loaded = optimizer.state_dict()["state"][number]
        assert loaded.keys() == state.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for name in state:
            assert torch.equal(loaded[name], state[name]), (number, name)
    assert optimizer.param_groups[0]["lr"] == inner.param_groups[0]["lr"]
    for (name, tensor), (_, mine) in zip(
        model.state_dict().items(), again.state_dict().items(), strict=True
    ):
        assert torch.equal(tensor, mine), name  # weights and the norm's statistics


def test_an_older_state_leaves_the_weights_as_healed_and_loads_the_rest(store, trained):
    model, inner = trained
    saved(store, model, inner)
    again, optimizer = restored(store, exact=False)
    fresh = small_model(seed=7)
    assert torch.equal(again[0].weight, fresh[0].weight)  # not loaded: behind the global ones
    assert torch.equal(again[1].running_mean, model[1].running_mean)  # a buffer: loaded
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"],
                       inner.state_dict()["state"][0]["exp_avg"])  # fmt: skip


def damage(store: Store, key: str, data: bytes) -> None:
    store.delete(key)
    store.put(key, data)


def commit_of(store: Store, round_: int = 3) -> ReplicaStateCommit:
    commit, _ = read_replica_state(store, LAYOUT, REPLICA, round_, 1 << 30, Spools())
    return commit


@pytest.mark.parametrize("how", ["flipped", "truncated"])
def test_a_damaged_object_is_refused_naming_its_key(store, trained, how):
    saved(store, *trained)
    key = commit_of(store).shards[0].key
    data = bytearray(store.get(key))
    if how == "flipped":
        data[-1] ^= 0xFF
    damage(store, key, bytes(data) if how == "flipped" else bytes(data[:-10]))
    with pytest.raises(
        CheckpointError, match=rf"^{key}: .* bytes( with CRC32C .*)?; the COMMIT says"
    ):
        read_replica_state(store, LAYOUT, REPLICA, 3, 1 << 30, Spools())


def rewrite_commit(store: Store, **changed) -> str:
    """The COMMIT with fields ``changed``, its own checksum right (as another program could
    write it): the reader meets the values."""
    key = LAYOUT.replica_state_commit(REPLICA, 3)
    body = json.loads(commit_of(store).model_dump_json()) | changed
    damage(store, key, record_bytes(json.dumps(body).encode()))
    return key


def test_a_commit_naming_other_sizes_is_refused_naming_the_key(store, trained):
    saved(store, *trained)
    entry = commit_of(store).state
    rewrite_commit(store, state={**entry.model_dump(), "size": entry.size + 1})
    with pytest.raises(CheckpointError, match=rf"^{entry.key}: {entry.size} bytes .* the COMMIT "
                       rf"says {entry.size + 1} bytes"):  # fmt: skip
        read_replica_state(store, LAYOUT, REPLICA, 3, 1 << 30, Spools())


def test_a_commit_naming_more_bytes_than_the_state_can_hold_is_refused_before_reading(
    store, trained
):
    saved(store, *trained)
    entry = commit_of(store).shards[0]
    key = rewrite_commit(store, shards=[{**entry.model_dump(), "size": 1 << 40}])
    with pytest.raises(CheckpointError, match=rf"^{key}: the COMMIT names 1099511\d+ bytes of "
                       rf"objects; allowed: at most {1 << 30}"):  # fmt: skip
        read_replica_state(store, LAYOUT, REPLICA, 3, 1 << 30, Spools())


@pytest.mark.parametrize(
    ("changed", "said"),
    [
        ({"replica": "local-2"}, "the COMMIT is for run own, replica local-2, round 3"),
        ({"state": {"key": "own/checkpoints/0000000000/state", "size": 1, "crc32c": 0}},
         "the COMMIT names own/checkpoints/0000000000/state, outside own/replicas/local-1"),
        ({"extra": 1}, "ReplicaStateCommit field extra: Extra inputs are not permitted"),
    ],
)  # fmt: skip
def test_a_malformed_commit_is_refused_naming_its_key(store, trained, changed, said):
    saved(store, *trained)
    key = rewrite_commit(store, **changed)
    with pytest.raises(CheckpointError, match=key) as refused:
        read_replica_state(store, LAYOUT, REPLICA, 3, 1 << 30, Spools())
    assert said in str(refused.value)


def test_a_state_of_another_model_is_refused_naming_the_parameter(store, trained):
    saved(store, *trained)
    with pytest.raises(ValueError, match=r"inner optimizer's exp_avg of parameter 0 \(0\.weight\) "
                       r"is \[16, 8\]; allowed: a scalar, or \[32, 8\]"):  # fmt: skip
        restored(store, width=32)


def test_a_state_of_another_optimizer_is_refused(store, trained):
    saved(store, *trained)
    model = small_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _, tree = read_replica_state(store, LAYOUT, REPLICA, 3, 1 << 30, Spools())
    with pytest.raises(ValueError, match="saved from a AdamW inner optimizer; this replica's is a "
                       "SGD"):  # fmt: skip
        load_own_state("k", tree, model, inner, with_weights=True, exact=True)


# -- OwnState: when a replica saves, which state it resumes, and what it falls back to ------


def config(every: int = 2, fragments: int = 1) -> RunConfig:
    return RunConfig.model_validate({
        "run": {"name": "own"}, "checkpoint": {"every": every},
        "diloco": {"sync_every": 4, "outer_steps": 6, "fragments": fragments},
    })  # fmt: skip


@pytest.fixture
def manager(store):
    """A real bucket-backed manager, its counters set by each test as healing would."""
    collective = Collective(store.url, replica="m", replicas=1)
    yield BucketManager.over(collective)
    collective.close()


def at(manager: BucketManager, round_: int) -> BucketManager:
    """The manager as after the committed sync of ``round_`` (every round committed)."""
    manager.load_state_dict({"step": round_ + 1, "batches_committed": round_ + 1,
                             "sync": round_ + 1})  # fmt: skip
    return manager


def own_state(store: Store, model: nn.Module, inner, replica: str = REPLICA) -> OwnState:
    return OwnState(config(), store, LAYOUT, replica, model, inner)


def test_a_replica_saves_at_the_checkpoint_steps_and_keeps_its_newest_two(store, trained, manager):
    state = own_state(store, *trained)
    for round_ in range(6):  # steps 1..6: due at 1, 2, 4 and 6 (every = 2, the last)
        state.save_if_due(at(manager, round_))
        state._pending.result()  # one at a time here, so none is skipped
    state.close()
    assert saved_rounds(store, LAYOUT, REPLICA) == [5, 3][:KEEP]
    assert {key.split("/")[4] for key in store.list_prefix(LAYOUT.replica_states(REPLICA))} == {
        "0000000005", "0000000003"
    }  # fmt: skip


def test_a_brand_new_replica_id_starts_fresh(store, trained, manager):
    saved(store, *trained)
    assert own_state(store, *trained, replica="local-9").resume(at(manager, 3)) is None


def test_a_replica_resumes_its_newest_state_up_to_the_round_healed_to(store, trained, manager):
    model, inner = trained
    for round_ in (1, 3, 7):  # 7: past the round healed to, from a run started over
        saved(store, model, inner, round_=round_, with_weights=False)  # fragments = 1
    state = own_state(store, model, inner)
    assert state.resume(at(manager, 3)) == "own state of round 3 restored: exact, the round " \
        "healed to"  # fmt: skip
    assert "own state of round 3 restored, older than round 5" in state.resume(at(manager, 5))


@pytest.mark.parametrize("how", ["truncated", "a low bit flipped"])
def test_a_damaged_state_is_passed_over_and_the_replica_starts_fresh(
    store, trained, manager, caplog, how
):
    """Truncated: refused by its size before any read. A low bit of a value flipped (still
    finite): found by the CRC32C taken as the moments are read, before any is loaded."""
    caplog.set_level(logging.WARNING)
    model, inner = trained
    saved(store, model, inner, with_weights=False)
    key = commit_of(store).shards[0].key
    data = bytearray(store.get(key))
    if how == "truncated":
        del data[-1]
    else:
        data[-4] ^= 0x01  # the last value's lowest mantissa bit (little-endian)
    damage(store, key, bytes(data))
    fresh = small_model(seed=7)
    optimizer = torch.optim.AdamW(fresh.parameters())
    assert own_state(store, fresh, optimizer).resume(at(manager, 3)) is None
    assert f"own state of round 3 not used: {key}: " in caplog.text
    assert optimizer.state_dict()["state"] == {}  # nothing loaded: fresh


def test_a_state_that_does_not_fit_is_passed_over_and_the_replica_starts_fresh(
    store, trained, manager, caplog
):
    caplog.set_level(logging.WARNING)
    saved(store, *trained, with_weights=False)
    wider = small_model(width=32)
    optimizer = torch.optim.AdamW(wider.parameters())
    assert own_state(store, wider, optimizer).resume(at(manager, 3)) is None
    assert "own state of round 3 not used: own/replicas/local-1/state/0000000003/COMMIT: the " \
        "inner optimizer's exp_avg of parameter 0 (0.weight)" in caplog.text  # fmt: skip
    assert optimizer.state_dict()["state"] == {}


def accumulated(model: nn.Module) -> ErrorFeedback:
    """Error feedback holding an accumulator for the whole model (one fragment)."""
    feedback = ErrorFeedback(0.95)
    numel = sum(p.numel() for p in model.parameters())
    feedback.compensate(0, [torch.linspace(-1.0, 1.0, numel)])
    return feedback


def test_the_error_feedback_comes_back_only_from_the_round_healed_to(store, trained, manager):
    """Saved at round 3: a replica healed to round 3 sends on what its accumulator held; one
    healed further starts it from zero, since later syncs sent part of it already."""
    model, inner = trained
    feedback = accumulated(model)
    save_replica_state(store, LAYOUT, REPLICA, 3, 4,
                        own_tree(model, inner, False, feedback))  # fmt: skip
    manager.feedback = ErrorFeedback(0.95)
    state = own_state(store, model, inner)
    assert state.resume(at(manager, 3)).endswith("exact, the round healed to")
    assert torch.equal(manager.feedback.residual(0), feedback.residual(0))
    manager.feedback = ErrorFeedback(0.95)
    assert state.resume(at(manager, 5)).endswith("; error feedback from zero")
    assert manager.feedback.residual(0) is None


def test_an_accumulator_of_another_size_is_refused_naming_the_key(store, trained, manager, caplog):
    caplog.set_level(logging.WARNING)
    model, inner = trained
    feedback = ErrorFeedback(0.95)
    feedback.compensate(0, [torch.ones(5)])
    save_replica_state(store, LAYOUT, REPLICA, 3, 4,
                        own_tree(model, inner, False, feedback))  # fmt: skip
    manager.feedback = ErrorFeedback(0.95)
    assert own_state(store, model, inner).resume(at(manager, 3)) is None
    assert "own/replicas/local-1/state/0000000003/COMMIT: error feedback '0' is not a float32 " \
        "accumulator of a fragment" in caplog.text  # fmt: skip
    assert manager.feedback.residual(0) is None


# -- exactness across processes ---------------------------------------------------------------

RUN_TOML = """
[run]
name = "own"
store = "store"
replicas = 2
min_replicas = 2  # the survivor waits for the restarted replica: the same rounds as without
[diloco]
sync_every = 4
outer_steps = 6
fragments = {fragments}
codec = "fp32"
[sync]
mode = "gather"
grace = 2.0
timeout = 600.0  # the restart, however slow the machine, is inside it
lease_period = 1.0
[checkpoint]
every = 2
[task]
log_every = 1
eval_every = 1
device = "cpu"
"""
KILLED = "local-1"


def batches(start: int, shard: int):
    target = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))
    for step in range(start, 10**6):
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(shard * 10**6 + step))
        yield x, x @ target


def held_out(model: nn.Module) -> float:
    target = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(-1 % 2**31))
    model.eval()
    try:
        with torch.no_grad():
            return float(nn.functional.mse_loss(model(x), x @ target))
    finally:
        model.train()


def script(folder: str, replica_id: str, kill_after: int, forget: bool) -> None:
    """A plain loop on the public API, drawing from every generator (dropout, and noise from
    Python's and NumPy's). Replica ``KILLED``'s first incarnation dies (``os._exit``, as a
    crash: nothing recorded) right after the sync that commits step ``kill_after``, once its
    own state of that round is in the bucket; with ``forget`` that state is deleted first."""
    torch.set_num_threads(1)
    random.seed(5)
    np.random.seed(5)
    model = small_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    joined = diloco_anywhere.join(f"{folder}/run.toml", replica_id=replica_id)
    with joined as replica, replica.diloco(model, inner, evaluate=held_out) as training:
        for x, y in training.batches(lambda start: batches(start, replica.index)):
            noise = 1 + 0.01 * (random.random() + float(np.random.rand()))
            loss = nn.functional.mse_loss(model(x * noise), y)
            loss.backward()
            inner.step()
            inner.zero_grad()
            training.log(loss)
            first = replica.collective.me.incarnation == 0
            if replica_id == KILLED and first and training.manager.current_step() == kill_after:
                die(replica, training.manager.last_round(), forget)
    result = training.result()
    Path(folder, f"{replica_id}.json").write_text(
        json.dumps({"loss": result.final_loss, "eval_loss": result.eval_loss})
    )


def die(replica, round_: int, forget: bool) -> None:
    """Wait (on the bucket, not the clock) until this replica's own state of ``round_`` is
    saved, drop it if ``forget``, and end the process at once."""
    store, layout = replica.collective.store, replica.collective.layout
    while round_ not in saved_rounds(store, layout, replica.replica_id):
        time.sleep(0.05)  # a poll's pause: the wait ends on the bucket's state, not on time
    if forget:
        store.delete_prefix(layout.replica_states(replica.replica_id))
    os._exit(9)


def run(folder: Path, fragments: int, kill_after: int | None, forget: bool = False) -> dict:
    """Two replicas to the end (``KILLED`` restarted with its id if it died); each replica's
    final loss and held-out loss, and the final checkpoint's fingerprint."""
    folder.mkdir()
    (folder / "run.toml").write_text(RUN_TOML.format(fragments=fragments))
    context = worker_context()

    def start(replica_id: str):
        process = context.Process(
            target=script, args=(str(folder), replica_id, kill_after or -1, forget)
        )
        process.start()
        return process

    survivor, killed = start("local-0"), start(KILLED)
    killed.join(300)
    if kill_after is not None:
        assert killed.exitcode == 9
        killed = start(KILLED)
        killed.join(300)
    survivor.join(300)
    assert (survivor.exitcode, killed.exitcode) == (0, 0)
    config = load_config(folder / "run.toml")
    store, layout = Store(config.store_url()), RunLayout("own")
    commit, _ = read_commit(store, layout, committed_rounds(store, layout)[0])
    results = {r: json.loads((folder / f"{r}.json").read_text()) for r in ("local-0", KILLED)}
    events = MetricsReader(store, layout).read()[KILLED].events
    return {"fingerprint": commit.fingerprint, "results": results,
            "resumed": [e.detail for e in events if e.event == "resumed"]}  # fmt: skip


@pytest.mark.integration
@pytest.mark.parametrize(("fragments", "kill_after"), [(1, 2), (2, 4)])
def test_a_replica_killed_after_a_checkpoint_step_resumes_exactly(tmp_path, fragments, kill_after):
    """The same final global weights (the last checkpoint's fingerprint) and the same losses,
    bit for bit, as the run in which no replica died; without its saved state the restarted
    replica re-warms a fresh AdamW and the run ends elsewhere."""
    uninterrupted = run(tmp_path / "uninterrupted", fragments, None)
    resumed = run(tmp_path / "killed", fragments, kill_after)
    assert resumed["resumed"] == [
        f"own state of round {kill_after - 1} restored: exact, the round healed to"
    ]
    assert resumed["fingerprint"] == uninterrupted["fingerprint"]
    assert resumed["results"] == uninterrupted["results"]
    if fragments == 1:
        fresh = run(tmp_path / "forgotten", fragments, kill_after, forget=True)
        assert fresh["resumed"] == []
        assert fresh["fingerprint"] != uninterrupted["fingerprint"]
        assert fresh["results"][KILLED]["loss"] != uninterrupted["results"][KILLED]["loss"]
