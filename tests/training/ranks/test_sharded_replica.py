"""Sharded replicas: FSDP2 inside each replica (torchrun, gloo on CPU here), every rank
exchanging its own shard through the bucket in a round namespace of its own.

The runs must train, hold the same global state on every replica bit for bit (the metrics'
fingerprints combine every rank's), match the same run with DDP inside each replica, and
survive a rank killed with SIGKILL: torchrun takes the replica down, the supervisor restarts
it, and every rank heals its own shard from its part of the checkpoint and its own rounds.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diloco_anywhere.bench.chaos import fingerprint_disagreements, unhealed_restarts
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.format.record import decode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.records import Manifest
from diloco_anywhere.config import ConfigError, load_config, parse_config
from diloco_anywhere.launching.keep.supervisor import Supervisor
from diloco_anywhere.launching.start.launch import plan_launch, run_metrics, start
from diloco_anywhere.replica import main as replica_main
from diloco_anywhere.tasks.gpt import GPT, PRESETS
from diloco_anywhere.training.checkpoints.commits import committed_rounds, read_commit
from diloco_anywhere.training.checkpoints.reader import load_checkpoint
from diloco_anywhere.training.checkpoints.records import ShardOf
from diloco_anywhere.training.ranks.replica_group import ReplicaGroup
from diloco_anywhere.training.ranks.sharding import (
    Sharding,
    ShardingMismatchError,
    check_sharded,
    check_sharding,
    shard_units,
)
from diloco_anywhere.training.recovery.healing import _together, _Verdict
from support.runs import RUN_TOML, as_streaming, diloco, evaluated_losses, replica_logs, statuses
from support.votes import voter

TWO_RANKS = "\n[backends.local]\nprocesses_per_replica = 2\n"
FRAGMENT = "StreamingDiLoCoFragment_0"


def _write_run(folder: Path, sharding: str, outer_steps: int, mirror: str = "") -> str:
    text = RUN_TOML.format(replicas=2, outer_steps=outer_steps).replace(
        "min_replicas = 2", f'min_replicas = 2\nsharding = "{sharding}"'
    )
    if mirror:
        text = text.replace("[task]", f'[checkpoint]\nmirrors = ["{mirror}"]\n[task]')
    (folder / "run.toml").write_text(text + TWO_RANKS)
    return str(folder / "run.toml")


def _final_weights(store: str) -> dict[str, torch.Tensor]:
    """The run's last checkpoint as one whole state (a sharded one's parts put together)."""
    layout = RunLayout("t")
    checkpoint = load_checkpoint(Store(store), layout, committed_rounds(Store(store), layout)[0])
    return checkpoint.tree["fragments"][FRAGMENT]["original_parameters"]


@pytest.mark.integration
def test_fsdp_replicas_sync_shard_by_shard_agree_match_ddp_and_resume_from_their_mirror(
    tmp_path, monkeypatch
):
    """One FSDP run (its checkpoints mirrored) and the same run with DDP inside each replica:
    the FSDP run syncs shard by shard, ends at DDP's model, mirrors every rank's part, and
    resumes from the mirror once its store is lost (one run serves all four: each is two
    replicas of two torchrun ranks)."""
    runs = {}
    for sharding in ("ddp", "fsdp"):
        folder = tmp_path / sharding
        folder.mkdir()
        monkeypatch.chdir(folder)
        mirrored = str(tmp_path / "mirror") if sharding == "fsdp" else ""
        config = _write_run(folder, sharding, outer_steps=3, mirror=mirrored)
        result = diloco("launch", "--config", config)
        assert result.exit_code == 0, result.output
        assert {row["state"] for row in statuses(config).values()} == {"done"}
        runs[sharding] = (folder, run_metrics(load_config(config)).read())

    folder, metrics = runs["fsdp"]
    assert fingerprint_disagreements(metrics) == {}
    for replica in metrics.values():
        assert [sync.committed and sync.contributed for sync in replica.syncs] == [True] * 3

    # Rank r of every replica claims and syncs in its own namespace: rank 0 in the run's,
    # rank 1 under ranks/1; each rank's contribution is its own shard, half the model.
    store, layout = Store(str(folder / "store")), RunLayout("t")
    for rank in (0, 1):
        claims = [
            k for k in store.list_prefix(RunLayout("t", rank).members()) if k.endswith("claim")
        ]
        assert len(claims) == 2, claims
    model_size = sum(p.numel() for p in _final_weights(str(folder / "store")).values())
    numels = []
    for rank in (0, 1):
        manifests = [
            key for key in store.list_prefix(RunLayout("t", rank).rounds())
            if "/manifests/" in key
        ]  # fmt: skip
        assert manifests, f"rank {rank} has no rounds"
        numels.append(decode_record(store.get(manifests[0]), Manifest, key=manifests[0]).numel)
    assert sum(numels) == model_size
    assert abs(numels[0] - numels[1]) < model_size * 0.1  # Shard(0): about half each

    # One COMMIT lists both ranks' parts; each part fingerprints as the COMMIT says.
    commit, _ = read_commit(store, layout, committed_rounds(store, layout)[0])
    assert len(commit.ranks) == 2
    assert all(entry.key.split("/")[3] == f"rank-{r:04d}"
               for r, part in enumerate(commit.ranks) for entry in part.shards)  # fmt: skip

    # The same run with DDP inside each replica ends at the same model (within rounding):
    # `diloco export` puts the sharded checkpoint's parts together into the whole model.
    exported = {}
    for sharding, (run_folder, _) in runs.items():
        monkeypatch.chdir(run_folder)
        result = diloco("export", str(run_folder / "model"), "--config", "run.toml")
        assert result.exit_code == 0, result.output
        exported[sharding] = load_file(run_folder / "model" / "model.safetensors")
    assert exported["ddp"].keys() == exported["fsdp"].keys()
    for name, expected in exported["ddp"].items():
        assert exported["fsdp"][name].shape == expected.shape
        torch.testing.assert_close(exported["fsdp"][name], expected, rtol=1e-5, atol=1e-6)

    # Every rank mirrored its part: the COMMIT as committed, over both ranks' parts, intact
    # in the mirror; the run's store lost, the same launch resumes from the mirror exactly.
    monkeypatch.chdir(folder)
    mirror = Store(str(tmp_path / "mirror"))
    rounds = committed_rounds(store, layout)
    assert committed_rounds(mirror, layout) == rounds == [2, 0]
    for round_ in rounds:
        assert read_commit(mirror, layout, round_)[1] == read_commit(store, layout, round_)[1]
        for rank in (0, 1):
            load_checkpoint(mirror, layout, round_, shard=ShardOf(rank, 2))
    trained = _final_weights(str(folder / "store"))
    shutil.rmtree(folder / "store")
    resumed = diloco("launch", "--config", "run.toml", "--resume-from", str(tmp_path / "mirror"))
    assert resumed.exit_code == 0, resumed.output
    for replica in run_metrics(load_config("run.toml")).read().values():
        healed = [event.detail for event in replica.events if event.event == "healed"]
        assert healed[-1].startswith("healed from checkpoint 2: replayed 0 rounds"), healed
    restored = _final_weights(str(folder / "store"))
    assert all(torch.equal(restored[name], trained[name]) for name in trained)


@pytest.mark.integration
def test_a_streaming_fsdp_run_evaluates_the_agreed_weights_and_trains_on(tmp_path, monkeypatch):
    """Each rank swaps its shards of every fragment's agreed weights in, the forward gathers
    them, and the model is resharded before the local shards come back: every replica reports
    one held-out loss per outer step, and the run goes on to its end. With the sparse codec:
    every rank sends its shard of each fragment through an error feedback of its own (the
    agreed weights and their evaluation are the codec's concern in no other way)."""
    monkeypatch.chdir(tmp_path)
    config = as_streaming(_write_run(tmp_path, "fsdp", outer_steps=2))
    Path(config).write_text(Path(config).read_text().replace('"fp32"', '"sparse"'))
    result = diloco("launch", "--config", config)
    assert result.exit_code == 0, result.output
    losses = evaluated_losses(config)
    assert sorted(losses) == [1, 2]
    assert all(len(values) == 1 for values in losses.values()), losses


def _rank_process(launcher_pid: int, rank: int) -> int:
    """The pid of ``rank``'s worker among torchrun's children."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher_pid and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no rank {rank} under torchrun {launcher_pid}")


@pytest.mark.integration
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
def test_a_rank_killed_takes_its_replica_down_and_the_restart_heals_every_rank(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    config = load_config(_write_run(tmp_path, "fsdp", outer_steps=8))
    plan = plan_launch(config, {"local": 2})
    supervisor = Supervisor(plan, start(plan), max_restarts=1)
    store, layout = Store(config.store_url()), RunLayout("t")
    deadline = time.monotonic() + 300
    # killed once local-1 is in round 2 and a checkpoint is committed, both read in the store
    # (a status's metrics lag rounds), with local-0 frozen meanwhile: local-1 then cannot end
    # the run before its rank is killed, however fast the machine trains
    launchers = {h.replica_id: h.job["pid"] for h in supervisor.handles}
    in_round_2 = layout.manifest(2, 0, "local-1", 0)
    while in_round_2 not in store.list_prefix(layout.manifests(2, 0)) or not (
        committed_rounds(store, layout)
    ):
        assert time.monotonic() < deadline, statuses(str(config.source))
        time.sleep(0.2)
    os.killpg(launchers["local-0"], signal.SIGSTOP)
    os.kill(_rank_process(launchers["local-1"], rank=1), signal.SIGKILL)
    os.killpg(launchers["local-0"], signal.SIGCONT)

    restarts: list[str] = []
    while supervisor.restarting or any(
        supervisor.state(handle) != "exited" for handle in supervisor.handles
    ):
        assert time.monotonic() < deadline, statuses(str(config.source))
        restarts += supervisor.restart_failed()
        time.sleep(0.2)
    assert [note.split(": ")[0] for note in restarts if "restarted" in note] == [
        "local-1 restarted (attempt 1)"
    ]
    assert {row["state"] for row in statuses(str(config.source)).values()} == {"done"}

    metrics = run_metrics(config).read()
    assert metrics["local-1"].incarnations == [0, 1]
    assert unhealed_restarts(metrics) == []
    healed = [e.detail for e in metrics["local-1"].events if e.event == "healed"]
    assert healed, metrics["local-1"].events
    assert healed[-1].startswith("healed from checkpoint "), healed
    assert fingerprint_disagreements(metrics) == {}
    for replica in metrics.values():
        last = replica.syncs[-1]
        assert (last.outer_step, last.committed) == (8, True)


def test_a_replica_unlike_the_runs_sharding_is_refused(tmp_path):
    store, layout = Store(str(tmp_path / "store")), RunLayout("t")
    check_sharding(store, layout, Sharding(sharding="fsdp", ranks=2), voter(0))
    check_sharding(store, layout, Sharding(sharding="fsdp", ranks=2), voter(1))  # the same: joins
    for other in (Sharding(sharding="fsdp", ranks=4), Sharding(sharding="ddp", ranks=1)):
        with pytest.raises(ShardingMismatchError) as refused:
            check_sharding(store, layout, other, voter(2, replicas=3))
        assert str(refused.value).startswith(
            f"this replica is {other.describe()}; the run's replicas are sharded over 2 "
            f"rank(s) (fsdp) (t/sharding, held by local-0, local-1). Every replica of a run "
            f"needs the same [run] sharding and, with fsdp, the same processes_per_replica"
        )


def test_a_replica_refused_for_its_sharding_exits_2_saying_why(tmp_path, monkeypatch, capsys):
    """Exit 2, as for any configuration that would only fail again: never restarted."""
    monkeypatch.chdir(tmp_path)
    config = _write_run(tmp_path, "fsdp", outer_steps=1)
    store = Store(str(tmp_path / "store"))
    check_sharding(store, RunLayout("t"), Sharding(sharding="fsdp", ranks=2), voter(1))
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # one process: sharded over 1 rank
    assert replica_main(["--config", config, "--replica-id", "local-0"]) == 2
    assert "error: replica local-0: this replica is sharded over 1 rank(s) (fsdp); the run's " \
        "replicas are sharded over 2 rank(s) (fsdp)" in capsys.readouterr().err  # fmt: skip


def test_fsdp_needs_one_rank_count_on_every_backend(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = RUN_TOML.format(replicas=2, outer_steps=1).replace(
        "min_replicas = 2", 'min_replicas = 2\nsharding = "fsdp"'
    )
    k8s = "\n[backends.k8s]\ngpus_per_pod = 4\nprocesses_per_replica = 4\n"
    two_platforms = text + TWO_RANKS + k8s
    with pytest.raises(ConfigError) as refused:
        plan_launch(parse_config(two_platforms, "run.toml"), {"local": 1, "k8s": 1})
    assert "needs the same processes_per_replica on every backend of the launch (found " \
        "local 2, k8s 4)" in str(refused.value)  # fmt: skip


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4)
        )
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))


def test_fsdp_shards_each_block_of_a_stack_as_its_own_unit() -> None:
    """A forward then gathers one block at a time, never the whole model."""
    gpt = GPT(PRESETS["tiny"], torch.Generator().manual_seed(0))
    assert shard_units(gpt) == list(gpt.blocks)  # an nn.Sequential of blocks

    hf_like = torch.nn.Module()
    hf_like.embed = torch.nn.Embedding(16, 4)
    hf_like.layers = torch.nn.ModuleList(_Block() for _ in range(2))  # experts stay inside
    assert shard_units(hf_like) == list(hf_like.layers)

    mixed = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    assert shard_units(mixed) == []  # no stack of blocks: the model is the one unit


def test_a_sharded_replicas_ranks_replay_a_round_only_together() -> None:
    """Healing decides each round from every rank's verdict, as the live sync does: any
    error fails all, a round some rank has no SEAL for ends the replay, any skip skips, and an
    applied round counts the fewest replicas in any rank's SEAL (every rank's counters, and
    so every rank's checkpoint part, stay alike)."""
    apply2, apply1 = _Verdict("apply", contributors=2), _Verdict("apply", contributors=1)
    assert _together([apply2, apply1]) == _Verdict("apply", contributors=1)
    assert _together([apply2, _Verdict("skip")]).kind == "skip"
    assert _together([_Verdict("skip"), _Verdict("open")]).kind == "open"
    failed = _together([_Verdict("open"), _Verdict("error", "round 4 cannot be replayed")])
    assert failed == _Verdict("error", "rank 1: round 4 cannot be replayed")


@pytest.mark.integration
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_every_rank_of_a_replica_paced_by_time_trains_the_steps_its_leader_planned(
    tmp_path, monkeypatch, sharding
):
    """Two replicas of two processes, one ten times slower a step (``bench/tools/slowed_task.py``),
    ``pace = "time"``: the leader plans each round's steps and its ranks take them (ranks that
    disagreed would never meet in the round), the slow replica trains fewer."""
    monkeypatch.chdir(tmp_path)
    config = _write_run(tmp_path, sharding, outer_steps=4)
    text = Path(config).read_text().replace('codec = "fp32"', 'codec = "fp32"\npace = "time"')
    text = text.replace(
        "[task]\n", '[task]\nentrypoint = "diloco_anywhere.bench.tools.slowed_task:build"\n'
    ).replace("[task.options]\n", "[task.options]\nspeeds = [1.0, 0.1]\nstep_seconds = 0.05\n")
    Path(config).write_text(text)
    result = diloco("launch", "--config", config)
    assert result.exit_code == 0, result.output + replica_logs(tmp_path, "t")
    metrics = run_metrics(load_config(config)).read()
    fast, slow = metrics["local-0"].syncs, metrics["local-1"].syncs
    assert [sync.round_steps for sync in fast] == [5] * 4
    assert all(sync.round_steps < 5 for sync in slow[2:]), [s.round_steps for s in slow]
    assert all(sync.committed and sync.participants == 2 for sync in fast + slow)


def test_the_entrypoint_refuses_a_run_toml_it_cannot_start_with_exit_2(tmp_path, capsys):
    """Nothing started: exit 2 (never retried), the problem said on stderr."""
    (tmp_path / "run.toml").write_text("[run]\nreplicas = 0\n")
    assert replica_main(["--config", str(tmp_path / "run.toml"), "--replica-id", "local-0"]) == 2
    assert "replicas" in capsys.readouterr().err


@pytest.fixture
def mesh_of_one(tmp_path):
    """A device mesh of this process alone (a gloo group of one, torn down after): what a
    DTensor needs."""
    from torch.distributed.device_mesh import init_device_mesh

    store = torch.distributed.FileStore(str(tmp_path / "group"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    torch.distributed.destroy_process_group()


def test_a_model_sharded_unlike_the_run_s_sharding_is_refused_either_way(mesh_of_one):
    """Before the first step, with exit 2 (a ConfigError): a replica of two processes
    declared "ddp" whose trainer sharded the model itself (torchtitan's FSDP2: rank 0 would
    sync its half as the whole), and one declared "fsdp" whose model was never sharded. A
    DTensor whose rank holds it whole (HSDP's replicated one), the model as declared, and one
    process alone, train. Rank 0's half of a parameter is a DTensor of the whole's shape
    holding half its rows (``DTensor.from_local`` with the whole's shape)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def model(*parameters: torch.Tensor) -> torch.nn.Module:
        module = torch.nn.Module()
        for k, parameter in enumerate(parameters):
            module.register_parameter(f"w{k}", torch.nn.Parameter(parameter))
        return module

    half = DTensor.from_local(torch.ones(2, 4), mesh_of_one, [Shard(0)], run_check=False,
                              shape=torch.Size([4, 4]), stride=(4, 1))  # fmt: skip
    whole = DTensor.from_local(torch.ones(4, 4), mesh_of_one, [Replicate()], run_check=False)
    ddp, fsdp = (ReplicaGroup(world_size=2, sharded=sharded) for sharded in (False, True))
    with pytest.raises(ShardingMismatchError, match=re.escape(
        "run.sharding = 'ddp', but parameter w1 is sharded over the replica's 2 processes (FSDP "
        'or tensor parallelism): set [run] sharding = "fsdp" in run.toml, so that every rank '
        "syncs its own shard"
    )):  # fmt: skip
        check_sharded(model(whole, half), ddp)
    with pytest.raises(ShardingMismatchError, match=re.escape(
        "run.sharding = 'fsdp', but parameter w0 is not sharded: pass the model through "
        "replica.parallelize(model) before building the inner optimizer"
    )):  # fmt: skip
        check_sharded(model(torch.ones(4)), fsdp)
    check_sharded(model(whole), ddp)
    check_sharded(model(half, whole), fsdp)
    for alone in (model(half), model(torch.ones(4))):
        check_sharded(alone, ReplicaGroup())
    assert issubclass(ShardingMismatchError, ConfigError)  # exit 2, never retried
