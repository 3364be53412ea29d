"""torchtitan's ``Trainer`` as a replica (``training/torchtitan/``, docs/api.md): two replicas
of its llama3 debug model started by ``diloco launch``, each ``python -m
diloco_anywhere.training.torchtitan`` with torchtitan's own arguments, on the CPU (gloo),
syncing only through the bucket, on the run's prepared corpus.

torchtitan 0.3.0's ``datasets`` caps fsspec below the version the project's environment pins,
so it lives in an environment of its own, as a user's ``pip install
'diloco-anywhere[torchtitan]'`` makes it: ``.tools/torchtitan`` (``make test`` builds it). The
replicas' entrypoint runs here; the command it starts runs there, named by its path."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from diloco_anywhere.bucket.format.layout import RunLayout, contributor, parse_contributor
from diloco_anywhere.bucket.format.record import decode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.records import Seal
from diloco_anywhere.config import load_config
from diloco_anywhere.data.claims import Claims
from diloco_anywhere.launching.start.launch import run_metrics
from diloco_anywhere.training.checkpoints.commits import committed_rounds
from support.runs import diloco, replica_logs, statuses

ROOT = Path(__file__).resolve().parents[2]
TORCHTITAN_PYTHON = ROOT / ".tools" / "torchtitan" / "bin" / "python"
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not TORCHTITAN_PYTHON.exists(),
        reason="torchtitan's environment is missing: make .tools/torchtitan (make test does)",
    ),
]
SEQ_LEN, BATCH = 64, 2
SYNC, OUTER = 3, 4  # inner steps a round, rounds
RUN = """
[run]
name = "titan"
store = "store"
replicas = 2
min_replicas = 2
[diloco]
sync_every = {sync}
outer_steps = {outer}
[sync]
timeout = 300.0
grace = 1.0  # the checkpoint's committer writes a frozen writer's shard after 3 x grace
[keep]
backoff = 0.5
[task]
data = "corpus"
log_every = 1
command = {command}
"""


def torchtitan_command(*extra: str) -> list[str]:
    """The replica's command: torchtitan's debug model at a test's sizes, its tokenizer the
    corpus's, its own dataset a copy of the text (built by the trainer, not read: the run's
    data replaces it)."""
    return [
        str(TORCHTITAN_PYTHON), "-m", "diloco_anywhere.training.torchtitan",
        "--module", "llama3", "--config", "llama3_debugmodel",
        "--hf_assets_path", "tokenizer", "--dataloader.dataset_path", "documents",
        "--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", str(BATCH),
        "--validator.no-enable", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def titan_run(hf_corpus, tmp_path_factory):
    """The run, launched once with ``--restart-on-failure``, and its folder: every test below
    asserts on it. Once the first checkpoint is committed, the replica that wrote it is
    SIGKILLed (its entrypoint and its trainer: the job's process group); the launch restarts
    it and it heals. Meanwhile the other replica is frozen, so that the run cannot end first
    (every round needs both)."""
    folder = tmp_path_factory.mktemp("titan")
    tokenizer, data = hf_corpus
    shutil.copytree(tokenizer, folder / "tokenizer")
    (folder / "documents").mkdir()
    shutil.copy(data, folder / "documents" / "data.jsonl")
    command = "[" + ", ".join(f'"{part}"' for part in torchtitan_command()) + "]"
    (folder / "run.toml").write_text(RUN.format(command=command, sync=SYNC, outer=OUTER))
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.setenv("HF_DATASETS_CACHE", str(folder / "datasets-cache"))
        prepared = diloco("data", "prepare", str(data), "corpus", "--tokenizer", "tokenizer")
        assert prepared.exit_code == 0, prepared.output
        diloco_cli = Path(sys.executable).with_name("diloco")
        launch = subprocess.Popen(
            [diloco_cli, "launch", "--config", "run.toml", "--restart-on-failure"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            _kill_the_first_checkpoints_writer(folder)
            output, _ = launch.communicate(timeout=600)
        finally:
            _end(launch, folder)
        assert launch.returncode == 0, output + replica_logs(folder, "titan")
        yield folder


def _job_groups(folder: Path) -> dict[str, int]:
    """Each replica's local job: its process group, entrypoint and trainer together."""
    launched = json.loads((folder / ".diloco" / "titan" / "launch.json").read_text())
    return {handle["replica_id"]: handle["job"]["pid"] for handle in launched["replicas"]}


def _end(launch: subprocess.Popen, folder: Path) -> None:
    """A launch that did not end on its own (a failed assertion) is ended with its replicas."""
    if launch.poll() is None:
        launch.kill()
        for group in _job_groups(folder).values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
    launch.wait()


def _kill_the_first_checkpoints_writer(folder: Path) -> None:
    store, layout = Store(str(folder / "store")), RunLayout("titan")
    deadline = time.monotonic() + 300
    while not (folder / "store" / layout.seal(0, 0)).exists():
        assert time.monotonic() < deadline, "round 0 was never sealed"
        time.sleep(0.1)
    seal = decode_record(store.get(layout.seal(0, 0)), Seal, key="seal")
    writer = parse_contributor(seal.contributors[0])[0]
    groups = _job_groups(folder)
    [other] = set(groups) - {writer}
    os.killpg(groups[other], signal.SIGSTOP)
    try:
        while not committed_rounds(store, layout):
            assert time.monotonic() < deadline, "the first checkpoint was never committed"
            time.sleep(0.1)
        os.killpg(groups[writer], signal.SIGKILL)
    finally:
        os.killpg(groups[other], signal.SIGCONT)


def test_two_torchtitan_replicas_train_the_run_to_one_model(titan_run, monkeypatch):
    monkeypatch.chdir(titan_run)
    rows = statuses("run.toml")
    assert {(row["state"], row["outer_step"]) for row in rows.values()} == {("done", OUTER)}
    metrics = run_metrics(load_config("run.toml")).read()
    committed = {
        (sync.outer_step, sync.fingerprint)
        for replica in metrics.values()
        for sync in replica.syncs
        if sync.committed
    }
    assert sorted(step for step, _ in committed) == list(range(1, OUTER + 1))  # one model
    for replica in metrics.values():  # torchtitan's logged loss, with its lr and grad norm
        assert set(replica.steps[0].values) == {"lr", "grad_norm"}
        assert replica.steps[-1].loss < replica.steps[0].loss


def test_a_killed_torchtitan_replica_is_restarted_and_healed_to_the_run(titan_run):
    metrics = run_metrics(load_config(titan_run / "run.toml")).read()
    [killed] = [name for name, replica in metrics.items() if replica.incarnations == [0, 1]]
    healed = [e for e in metrics[killed].events_by_incarnation[1] if e.event == "healed"]
    assert "healed from checkpoint" in healed[0].detail
    [other] = set(metrics) - {killed}
    assert [line.step for line in metrics[other].steps] == list(range(1, SYNC * OUTER + 1))


def test_torchtitan_replicas_train_each_unit_of_the_run_s_data_once(titan_run):
    store = Store(str(titan_run / "store"))
    claims = Claims(store, RunLayout("titan"), contributor("judge", 0), 2).every_claim()
    trained = sorted(claim.unit for claim, outcome in claims if outcome == "trained")
    assert trained == list(range(2 * OUTER))  # 2 replicas x 4 rounds, each unit once


def test_a_torchtitan_run_exports_its_model(titan_run, monkeypatch):
    monkeypatch.chdir(titan_run)
    assert diloco("export", "exported", "--config", "run.toml").exit_code == 0
    exported = load_file("exported/model.safetensors")
    assert "tok_embeddings.weight" in exported
