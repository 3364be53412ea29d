"""Healing from the bucket alone: a replica that was not there catches up bit for bit.

Two real replica processes train a short run (torchft's DiLoCo, the built-in GPT); then, in this
process, a newcomer heals from what they left in the bucket and must hold exactly the global
state of the run's final checkpoint, whichever way it gets there.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from diloco_anywhere.bench.tools.processes import worker_context
from diloco_anywhere.bucket.feedback import ErrorFeedback
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.format.record import encode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.allreduce import BucketCollective
from diloco_anywhere.collective.errors import DivergedError, ModelMismatchError
from diloco_anywhere.collective.records import Seal
from diloco_anywhere.config import RunConfig, load_config
from diloco_anywhere.replica import run_replica
from diloco_anywhere.task import build_task
from diloco_anywhere.training.builders import (
    build_parts,
    inner_optimizer,
    task_context,
)
from diloco_anywhere.training.checkpoints.commits import committed_rounds
from diloco_anywhere.training.checkpoints.reader import load_checkpoint, read_checkpoint
from diloco_anywhere.training.checkpoints.writer import CheckpointPolicy, CheckpointWriter
from diloco_anywhere.training.mistakes import ModelUnlikeRunError
from diloco_anywhere.training.ranks.replica_group import ReplicaGroup
from diloco_anywhere.training.records.metrics import MetricsReader, MetricsWriter
from diloco_anywhere.training.recovery.healing import HealError, heal
from diloco_anywhere.training.recovery.mirrors import copy_checkpoint
from diloco_anywhere.training.state.fingerprints import fingerprint
from diloco_anywhere.training.training import Training
from support.checkpoints import record_bytes, rewrite_counters
from support.proxy import Fault, FaultProxy

# every test heals from, or damages a copy of, a run that processes trained (train())
pytestmark = pytest.mark.integration

OUTER_STEPS = 6
RUN_TOML = f"""
[run]
name = "h"
store = "store"
replicas = 2
min_replicas = 2
seed = {{seed}}
[diloco]
sync_every = 4
outer_steps = {OUTER_STEPS}
codec = "fp32"
[sync]
mode = "gather"
grace = 2.0
timeout = 60.0
lease_period = 1.0
keep_rounds = 100  # every round stays: tests drop checkpoints and replay from further back
[checkpoint]
every = 100  # so: after the first committed sync and after the last
[task]
log_every = 4
eval_every = 0
device = "cpu"
[task.options]
preset = "tiny"
seq_len = 32
batch_size = 2
corpus_bytes = 200000
"""
LAYOUT = RunLayout("h")


def _replica(config_path: str, index: int) -> None:
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(1)
    run_replica(load_config(config_path), f"local-{index}", index, "local")


def train(folder: Path) -> Path:
    """Train a two-replica run in ``folder`` (run.toml and its store) to its end."""
    (folder / "run.toml").write_text(RUN_TOML.format(seed=0))
    context = worker_context()
    processes = [
        context.Process(target=_replica, args=(str(folder / "run.toml"), index))
        for index in range(2)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(180)
    assert [process.exitcode for process in processes] == [0, 0]
    return folder


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """The folder of a finished two-replica run: run.toml and its store."""
    return train(tmp_path_factory.mktemp("healing"))


@pytest.fixture
def run(finished_run, tmp_path) -> Path:
    """A copy of the finished run that a test may damage."""
    shutil.copytree(finished_run, tmp_path / "run")
    return tmp_path / "run"


def replica_parts(config, collective):
    """What the built-in loop trains replica 0 with (``training.train``)."""
    task = build_task(config.task.entrypoint, task_context(config, 0, ReplicaGroup()))
    inner = inner_optimizer(config, task.model)
    return build_parts(config, collective, task.model, inner, task.tokens_per_batch)


def newcomer(
    folder: Path,
    seed: int = 0,
    from_initial: bool = True,
    min_replicas: int = 2,
    mirrors: tuple[Store, ...] = (),
    seq_len: int = 32,
):
    """Build a third replica in this process and heal it; (report, its global state, parts)."""
    torch.set_num_threads(1)  # as the replicas ran: the mean's rounding follows thread counts
    text = RUN_TOML.format(seed=seed).replace("seq_len = 32", f"seq_len = {seq_len}")
    (folder / "run.toml").write_text(text)
    config = load_config(folder / "run.toml")
    store = Store(config.store_url())
    collective = BucketCollective(store, "h", "newcomer", config.collective_config())
    try:
        parts = replica_parts(config, collective)
        with parts.diloco():
            state = parts.global_state()
            report = heal(
                collective, state, parts.manager, min_replicas,
                from_initial=from_initial, mirrors=mirrors,
            )  # fmt: skip
            return report, state, parts
    finally:
        collective.close()


def final_checkpoint(folder: Path):
    store = Store(str(folder / "store"))
    return load_checkpoint(store, LAYOUT, committed_rounds(store, LAYOUT)[0])


def assert_holds_the_runs_final_state(state, parts, final) -> None:
    step = final.commit.step
    assert fingerprint(step, state.checksum()) == final.commit.fingerprint
    weights = final.tree["fragments"]["StreamingDiLoCoFragment_0"]["original_parameters"]
    for name, parameter in parts.fragments[0].named_parameters():
        assert torch.equal(parameter.data, weights[name]), name  # local weights = global ones


def drop_checkpoint(folder: Path, round_: int) -> None:
    Store(str(folder / "store")).delete_prefix(LAYOUT.checkpoint(round_))


def test_the_run_left_a_first_and_a_final_checkpoint(finished_run) -> None:
    store = Store(str(finished_run / "store"))
    assert committed_rounds(store, LAYOUT) == [OUTER_STEPS - 1, 0]
    assert final_checkpoint(finished_run).commit.step == OUTER_STEPS


def test_a_newcomer_loads_the_newest_checkpoint(run) -> None:
    final = final_checkpoint(run)
    report, state, parts = newcomer(run)
    assert (report.checkpoint, report.replayed, report.sync) == (OUTER_STEPS - 1, 0, OUTER_STEPS)
    assert_holds_the_runs_final_state(state, parts, final)


def test_a_newcomer_replays_the_rounds_after_an_older_checkpoint_bit_for_bit(run) -> None:
    final = final_checkpoint(run)
    drop_checkpoint(run, OUTER_STEPS - 1)
    report, state, parts = newcomer(run, from_initial=False)
    assert (report.checkpoint, report.replayed, report.skipped) == (0, OUTER_STEPS - 1, 0)
    assert parts.manager.current_step() == OUTER_STEPS
    assert_holds_the_runs_final_state(state, parts, final)


def test_a_newcomer_of_another_model_is_stopped_as_unlike_the_run_naming_the_weights(run):
    """A replica started after the run's first checkpoint (``diloco replace``, a late joiner)
    is no longer compared with the initial model; its model of another size (here another
    seq_len, so another position embedding) does not fit any checkpoint: it stops as unlike
    the run (exit 5, never retried), naming the weights, where it failed as a heal that a
    restart might fix."""
    with pytest.raises(ModelUnlikeRunError) as unlike:
        newcomer(run, seq_len=48)
    said = str(unlike.value)
    assert "this replica's model does not fit the run's checkpoints" in said
    assert "position_embedding.weight are [32, 64] torch.float32; the parameter's [48, 64]" in said
    assert "Every replica must build the same model" in said


def test_a_replica_that_heals_to_the_end_commits_the_last_checkpoint_nobody_committed(run):
    """The last round's committer was killed writing its checkpoint (an attempt's time limit),
    the other replica too: the run's end is its last COMMIT, so the restarted replica, which
    heals to the end and trains nothing, writes it before it says done, bit for bit the run's."""
    final = final_checkpoint(run)
    store, last = Store(str(run / "store")), OUTER_STEPS - 1
    store.delete(LAYOUT.checkpoint_commit(last))
    store.delete(LAYOUT.checkpoint_shard(last, 0))  # its writer died before writing it
    process = worker_context().Process(target=_replica, args=(str(run / "run.toml"), 0))
    process.start()
    process.join(180)
    assert process.exitcode == 0
    assert committed_rounds(store, LAYOUT)[0] == last
    rewritten = final_checkpoint(run)
    assert rewritten.commit.fingerprint == final.commit.fingerprint
    assert rewritten.commit.shards == final.commit.shards  # the same plan, the same bytes
    events = MetricsReader(store, LAYOUT).read()["local-0"].events
    assert events[-1].event == "done", events[-1]
    healed = [event for event in events if event.event == "healed"]
    assert [event.outer_step for event in (healed[-1], events[-1])] == [OUTER_STEPS] * 2


def test_without_checkpoints_a_fresh_replica_replays_from_its_initial_state(run) -> None:
    final = final_checkpoint(run)
    drop_checkpoint(run, OUTER_STEPS - 1)
    drop_checkpoint(run, 0)
    report, state, parts = newcomer(run)
    assert (report.checkpoint, report.replayed) == (None, OUTER_STEPS)
    assert_holds_the_runs_final_state(state, parts, final)
    with pytest.raises(HealError, match="no committed checkpoint in the bucket heals"):
        newcomer(run, from_initial=False)  # a replica that trained has no initial state left


def test_a_corrupt_checkpoint_is_skipped_with_the_reason_logged(run, caplog) -> None:
    caplog.set_level(logging.WARNING)
    final = final_checkpoint(run)
    store = Store(str(run / "store"))
    key = final.commit.shards[0].key
    damaged = bytearray(store.get(key))
    damaged[-1] ^= 0xFF
    store.delete(key)
    store.put(key, bytes(damaged))
    report, state, parts = newcomer(run)
    assert (report.checkpoint, report.replayed) == (0, OUTER_STEPS - 1)
    assert_holds_the_runs_final_state(state, parts, final)
    assert f"checkpoint of round {OUTER_STEPS - 1} not used: {key}" in caplog.text


def test_a_replica_built_differently_cannot_heal_and_says_why(run) -> None:
    drop_checkpoint(run, OUTER_STEPS - 1)
    drop_checkpoint(run, 0)
    with pytest.raises(HealError, match="round 0 was sealed by replicas holding step-0-"):
        newcomer(run, seed=1)  # another seed: other initial weights


def test_rounds_gone_from_the_bucket_stop_healing_with_the_round_named(run, caplog) -> None:
    caplog.set_level(logging.WARNING)
    drop_checkpoint(run, OUTER_STEPS - 1)
    Store(str(run / "store")).delete_prefix(LAYOUT.parts(3, 0, "local-1", 0))
    with pytest.raises(HealError, match="no committed checkpoint in the bucket heals"):
        newcomer(run)
    assert "healing from checkpoint 0 failed: round 3 cannot be replayed: its data is gone" in (
        caplog.text
    )


def test_a_replica_whose_state_diverged_says_so_and_heals(run) -> None:
    """What the training loop does on a ``DivergedError``: a loud ``diverged`` event, then a
    heal from the bucket back to the run's state, where the error feedback held for rounds
    onto the diverged weights starts again from zero."""
    final = final_checkpoint(run)
    config = load_config(run / "run.toml")
    store = Store(config.store_url())
    collective = BucketCollective(store, "h", "local-0", config.collective_config())
    metrics = MetricsWriter(store, LAYOUT, "local-0", collective.me.incarnation, "local")
    try:
        parts = replica_parts(config, collective)
        with parts.diloco():
            state = parts.global_state()
            loop = Training(parts, collective, metrics, ReplicaGroup())
            loop.heal(state, from_initial=True)
            feedback = parts.manager.feedback = ErrorFeedback()  # as with codec = "sparse"
            feedback.compensate(0, [torch.ones(3)])  # what a codec left out of earlier rounds
            tree = state.fragments_tree()
            weights = tree["StreamingDiLoCoFragment_0"]["original_parameters"]
            next(iter(weights.values())).add_(1e-3)  # a commit the others did not make
            state.load_fragments_tree(tree)
            assert fingerprint(final.commit.step, state.checksum()) != final.commit.fingerprint
            parts.manager.last_sync_error = DivergedError("round 9: this replica's state differs")
            loop.after_divergence(state)
            assert_holds_the_runs_final_state(state, parts, final)
            assert feedback.residual(0) is None
    finally:
        collective.close()
    events = MetricsReader(store, LAYOUT).read()["local-0"].events
    assert [event.event for event in events][-2:] == ["diverged", "healed"]
    assert "round 9: this replica's state differs" in events[-2].detail


def test_a_replayed_round_with_a_malformed_record_fails_healing_with_its_key(run, caplog) -> None:
    """A sealed round's manifest damaged after the others applied the round: the replay skips
    it as unreadable, the next round's fingerprint then disagrees, and healing falls back
    through the older checkpoints saying which round was skipped and why, never raising."""
    caplog.set_level(logging.WARNING)
    drop_checkpoint(run, OUTER_STEPS - 1)
    store = Store(str(run / "store"))
    key = LAYOUT.manifest(3, 0, "local-1", 0)
    store.delete(key)
    store.put(key, b"DLAR not a record")
    with pytest.raises(HealError, match="no committed checkpoint in the bucket heals"):
        newcomer(run)
    assert "healing from checkpoint 0 failed: round 4 was sealed by replicas holding" in caplog.text
    assert "or round 3 was skipped as unreadable (round 3 fragment 0: sealed contribution" in (
        caplog.text
    )
    assert key in caplog.text


def mirror_of(folder: Path) -> Store:
    """A mirror of the run's checkpoints, as ``[checkpoint] mirrors`` leaves one."""
    primary, mirror = Store(str(folder / "store")), Store(str(folder / "mirror"))
    for round_ in committed_rounds(primary, LAYOUT):
        copy_checkpoint(mirror, LAYOUT, read_checkpoint(primary, LAYOUT, round_))
    return mirror


def corrupt_checkpoint(folder: Path, round_: int) -> str:
    store = Store(str(folder / "store"))
    key = load_checkpoint(store, LAYOUT, round_).commit.shards[0].key
    damaged = bytearray(store.get(key))
    damaged[-1] ^= 0xFF
    store.delete(key)
    store.put(key, bytes(damaged))
    return key


def test_a_newcomer_heals_from_a_mirror_where_the_stores_checkpoints_are_lost(run, caplog):
    """The store lost its final checkpoint and holds a damaged first one; the mirror's first
    is used and the rounds after it replayed. The mirror's final checkpoint is not: no round
    sealed after it in the store confirms it is this run's state."""
    caplog.set_level(logging.WARNING)
    final, mirror = final_checkpoint(run), mirror_of(run)
    drop_checkpoint(run, OUTER_STEPS - 1)
    key = corrupt_checkpoint(run, 0)
    report, state, parts = newcomer(run, from_initial=False, mirrors=(mirror,))
    assert (report.checkpoint, report.mirror, report.replayed) == (0, mirror.url, OUTER_STEPS - 1)
    assert f"of mirror {mirror.url}: replayed {OUTER_STEPS - 1} rounds" in report.describe()
    assert_holds_the_runs_final_state(state, parts, final)
    assert f"the run's store has not sealed round {OUTER_STEPS}, which would confirm" in caplog.text
    assert f"checkpoint of round 0 not used: {key}" in caplog.text  # the store's, then the mirror's


def test_the_stores_own_checkpoint_comes_before_a_mirrors(run):
    report, _, _ = newcomer(run, mirrors=(mirror_of(run),))
    assert (report.checkpoint, report.mirror) == (OUTER_STEPS - 1, None)


def test_a_mirror_that_cannot_be_read_is_skipped(run, standins, caplog):
    """A mirror whose every request is refused (expired credentials) before one that works:
    healing logs it and goes on to the next."""
    caplog.set_level(logging.WARNING)
    server, mirror = standins("s3"), mirror_of(run)
    drop_checkpoint(run, OUTER_STEPS - 1)
    corrupt_checkpoint(run, 0)
    with FaultProxy(server.storage_options["endpoint_url"]) as proxy:
        proxy.inject(Fault("GET", status=403, code="AccessDenied", times=10**6))
        options = server.storage_options | {"endpoint_url": proxy.url}
        down = Store(f"{server.url}/mirror-{run.parent.name}", storage_options=options)
        report, _, _ = newcomer(run, from_initial=False, mirrors=(down, mirror))
    assert (report.checkpoint, report.mirror) == (0, mirror.url)
    assert f"mirror {down.url} not used: its checkpoints cannot be listed" in caplog.text
    assert "access denied" in caplog.text


def stale_checkpoint(folder: Path, mirror: Store, as_round: int) -> None:
    """Write into ``mirror`` the run's final state as the checkpoint of ``as_round``: what an
    earlier run of the same name (started over) leaves in a mirror, valid but not this run's
    state at that round."""
    tree = final_checkpoint(folder).tree
    tree["manager"] = {**tree["manager"], "step": as_round + 1, "sync": as_round + 1}
    writer = CheckpointWriter(mirror, LAYOUT, "earlier-0", CheckpointPolicy.of(RunConfig()))
    writer.write(as_round, ("earlier-0",), tree, last=True)
    writer.close()


def test_a_mirrors_checkpoint_from_an_earlier_run_of_the_same_name_is_not_used(run, caplog):
    """Round 3's checkpoint in the mirror loads intact, but round 4 was sealed from another
    state: it is refused before anything is loaded, so a fresh replica still replays from its
    initial state."""
    caplog.set_level(logging.WARNING)
    final, mirror = final_checkpoint(run), Store(str(run / "mirror"))
    stale_checkpoint(run, mirror, as_round=3)
    assert load_checkpoint(mirror, LAYOUT, 3).commit.sync == 4  # intact, as a checkpoint
    drop_checkpoint(run, OUTER_STEPS - 1)
    drop_checkpoint(run, 0)
    report, state, parts = newcomer(run, mirrors=(mirror,))
    assert (report.checkpoint, report.replayed) == (None, OUTER_STEPS)
    assert_holds_the_runs_final_state(state, parts, final)
    assert "round 4 was sealed from state step-4-" in caplog.text
    assert "it is from an earlier run of the same name" in caplog.text


# -- damage that must never stop a heal -----------------------------------------------------


def rewrite_checkpoint(folder: Path, round_: int, change: Callable[[dict], None]) -> None:
    """Write the checkpoint of ``round_`` again, by the real writer, from its own state as
    ``change`` leaves it: its CRC32Cs and fingerprint agree with its bytes, whatever they hold."""
    store = Store(str(folder / "store"))
    tree = load_checkpoint(store, LAYOUT, round_).tree
    change(tree)
    store.delete_prefix(LAYOUT.checkpoint(round_))
    writer = CheckpointWriter(store, LAYOUT, "x-0", CheckpointPolicy.of(RunConfig()))
    writer.write(round_, ("x-0",), tree, last=True)
    writer.close()


def assert_healed_past_the_final_checkpoint(folder: Path, final, caplog, said: str) -> None:
    """A newcomer passes over the final checkpoint (logging ``said``), loads the first and
    replays every round after it to the run's final state."""
    report, state, parts = newcomer(folder, from_initial=False)
    assert (report.checkpoint, report.replayed) == (0, OUTER_STEPS - 1)
    assert_holds_the_runs_final_state(state, parts, final)
    assert f"checkpoint of round {OUTER_STEPS - 1} not used: {said}" in caplog.text


@pytest.mark.parametrize(
    ("counters", "said"),
    [
        ({"sync": 10**10}, "COMMIT: CheckpointCommit field sync: Input should be less than"),
        ({"step": OUTER_STEPS + 1}, f"step {OUTER_STEPS + 1} must be at most sync {OUTER_STEPS}"),
        ({"batches_committed": -1}, "state: counter batches_committed is -1; allowed"),
    ],
)
def test_a_checkpoint_whose_counters_no_manager_holds_is_passed_over(
    run, caplog, counters, said
) -> None:
    """The final checkpoint's state and COMMIT agree on counters out of range or unlike the
    manager's: it is refused naming its key and the counter, and the first one is healed
    from. Before, sync 10**10 loaded and the replay raised a ValueError out of ``heal``."""
    caplog.set_level(logging.WARNING)
    final = final_checkpoint(run)
    rewrite_counters(Store(str(run / "store")), LAYOUT, OUTER_STEPS - 1, **counters)
    assert_healed_past_the_final_checkpoint(run, final, caplog, "h/checkpoints/0000000005/")
    assert said in caplog.text


FRAGMENT = "['fragments']['StreamingDiLoCoFragment_0']"


@pytest.mark.parametrize("value", [torch.nan, -torch.inf])
def test_a_checkpoint_whose_weights_are_not_finite_is_passed_over(run, caplog, value) -> None:
    """NaN or inf in the final checkpoint's global weights, its CRC32Cs and fingerprint
    consistent: refused as damaged, naming the shard's key and the tensor. Before, a newcomer
    healed to NaN weights."""
    caplog.set_level(logging.WARNING)
    final = final_checkpoint(run)
    weights = final.tree["fragments"]["StreamingDiLoCoFragment_0"]["original_parameters"]
    name = next(iter(weights))

    def poison(tree: dict) -> None:
        tree["fragments"]["StreamingDiLoCoFragment_0"]["original_parameters"][name][0] = value

    rewrite_checkpoint(run, OUTER_STEPS - 1, poison)
    tensor = f"{FRAGMENT}['original_parameters']['{name}']"
    key = LAYOUT.checkpoint_shard(OUTER_STEPS - 1, 0)
    assert_healed_past_the_final_checkpoint(run, final, caplog, f"{key}: tensor {tensor} holds")


def test_a_checkpoint_whose_momentum_is_shaped_unlike_its_parameter_is_passed_over(
    run, caplog
) -> None:
    """The final checkpoint's outer momentum of the first parameter flattened: the same bytes,
    so the same fingerprint, and torch's optimizer loads it without a word (then fails the
    outer step of a replay). Refused before anything is loaded, and the first one healed
    from."""
    caplog.set_level(logging.WARNING)
    final = final_checkpoint(run)

    def flatten_momentum(tree: dict) -> None:
        state = tree["fragments"]["StreamingDiLoCoFragment_0"]["outer_optimizer"]["state"][0]
        state["momentum_buffer"] = state["momentum_buffer"].reshape(-1)

    rewrite_checkpoint(run, OUTER_STEPS - 1, flatten_momentum)
    assert_healed_past_the_final_checkpoint(run, final, caplog, "it does not fit this replica")
    assert "StreamingDiLoCoFragment_0: the outer optimizer's momentum_buffer of parameter 0" in (
        caplog.text
    )


def test_a_commit_key_past_the_last_round_is_no_checkpoint_to_heal_from(run) -> None:
    """An object at the COMMIT key of round 10**10 (11 digits): healing passes over it."""
    final, store = final_checkpoint(run), Store(str(run / "store"))
    store.put(f"{LAYOUT.checkpoints()}/{10**10}/COMMIT", store.get(LAYOUT.checkpoint_commit(0)))
    report, state, parts = newcomer(run)
    assert report.checkpoint == OUTER_STEPS - 1
    assert_holds_the_runs_final_state(state, parts, final)


def _seal(round_: int) -> Seal:
    contributors = ("local-0-0", "local-1-0")
    return Seal(run="h", round=round_, fragment=0, contributors=contributors, mode="gather",
                sealed_by="local-0-0")  # fmt: skip


def _record(seal: Seal, **changed) -> bytes:
    """``seal`` with fields ``changed``, its checksum right."""
    return record_bytes(json.dumps(json.loads(seal.model_dump_json()) | changed).encode())


def unreadable_seals() -> dict[int, bytes]:
    """SEALs no replica can read, by round: each put before the run starts, so the live
    replicas meet it, fail that round alike and commit none of them."""
    corrupt = bytearray(encode_record(_seal(4)))
    corrupt[-2] ^= 0x01
    return {
        2: _record(_seal(2), quorum=2),  # a field this release lacks
        4: bytes(corrupt),  # a checksum that fails
        5: encode_record(_seal(4)),  # another round's
        7: _record(_seal(7), contributors=["local-1-0", "local-0-0"]),
        8: _record(_seal(8), sealed_by="../local-0-0"),  # a name no replica has
    }


@pytest.fixture(scope="module")
def run_past_unreadable_seals(tmp_path_factory) -> Path:
    """A finished two-replica run that met an unreadable SEAL in five of its rounds."""
    folder = tmp_path_factory.mktemp("unreadable-seals")
    store = Store(str(folder / "store"))
    for round_, data in unreadable_seals().items():
        store.put(LAYOUT.seal(round_, 0), data)
    return train(folder)


@pytest.mark.parametrize("checkpoint", [0, None])
def test_a_newcomer_skips_the_rounds_whose_seal_the_live_replicas_could_not_read(
    run_past_unreadable_seals, tmp_path, caplog, checkpoint
) -> None:
    """The live replicas failed every round with an unreadable SEAL and went on; a newcomer
    replaying those rounds (after the first checkpoint, or from its initial state) skips them
    alike and holds the live replicas' final state. Before, a SEAL with a field it did not
    know stopped the heal."""
    caplog.set_level(logging.WARNING)
    folder = Path(shutil.copytree(run_past_unreadable_seals, tmp_path / "run"))
    skipped = len(unreadable_seals())
    last = OUTER_STEPS - 1 + skipped
    assert committed_rounds(Store(str(folder / "store")), LAYOUT) == [last, 0]
    final = final_checkpoint(folder)
    assert final.commit.step == OUTER_STEPS  # the live replicas committed none of those rounds
    for round_ in (last, 0) if checkpoint is None else (last,):
        drop_checkpoint(folder, round_)
    report, state, parts = newcomer(folder, from_initial=checkpoint is None)
    first = 0 if checkpoint is None else 1
    assert (report.checkpoint, report.replayed) == (checkpoint, OUTER_STEPS - first)
    assert (report.skipped, report.sync) == (skipped, last + 1)
    assert_holds_the_runs_final_state(state, parts, final)
    for round_ in unreadable_seals():
        assert f"round {round_} was skipped as unreadable (" in caplog.text
    assert f"{LAYOUT.seal(2, 0)}: Seal field quorum: Extra inputs are not permitted" in caplog.text


def test_a_round_of_another_size_is_refused_before_its_size_is_allocated(run) -> None:
    """The sealed manifest's size is checked against this model's before a buffer of that
    size exists: a round of another model names both sizes instead of allocating its size."""
    weights = final_checkpoint(run).tree["fragments"]["StreamingDiLoCoFragment_0"]
    numel = sum(t.numel() for t in weights["original_parameters"].values())
    collective = BucketCollective(Store(str(run / "store")), "h", "observer")
    try:
        result, mean = collective.observe(0, numel)
        assert (mean.numel(), result.seal.round) == (numel, 0)
        with pytest.raises(ModelMismatchError, match=rf"round 0 does not apply to this model: "
                           rf"its result has {numel} values, the fragment 7$"):  # fmt: skip
            collective.observe(0, 7)
    finally:
        collective.close()
