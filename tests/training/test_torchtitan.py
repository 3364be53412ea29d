"""torchtitan's ``Trainer`` as a replica (``training/torchtitan/``, docs/api.md): two replicas
of its llama3 debug model started by ``diloco launch``, each ``python -m
diloco_anywhere.training.torchtitan`` with torchtitan's own arguments, on the CPU (gloo),
syncing only through the bucket, on the run's raw text prepared with the job's tokenizer.

torchtitan lives in an environment of its own (``support/torchtitan.py``): the replicas'
entrypoint runs here; the command it starts runs there, named by its path."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaForCausalLM

from diloco_anywhere.bucket.format.layout import RunLayout, contributor, parse_contributor
from diloco_anywhere.bucket.format.record import decode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.records import Seal
from diloco_anywhere.config import load_config
from diloco_anywhere.contract import EXIT_BAD_CONFIG, NOT_RETRIED
from diloco_anywhere.data.claims import Claims
from diloco_anywhere.launching.start.launch import run_metrics
from diloco_anywhere.training.checkpoints.commits import committed_rounds
from diloco_anywhere.training.torchtitan.cpu import TorchtitanVersionError, check_version
from support.docs import example
from support.runs import diloco, replica_logs, statuses
from support.torchtitan import DEBUG_ASSETS, TORCHTITAN_PYTHON, needs_torchtitan

SYNC, OUTER = 3, 4  # docs/api.md's run: inner steps a round, rounds
TEST_SETTINGS = """
log_every = 1
[sync]
timeout = 300.0
grace = 1.0  # the checkpoint's committer writes a frozen writer's shard after 3 x grace
[keep]
backoff = 0.5
"""


def docs_run() -> str:
    """docs/api.md's run.toml, its replicas' interpreter torchtitan's environment's, with a
    test's settings after its last table, ``[task]``."""
    run = example("# torchtitan's run.toml", "toml")
    assert f"sync_every = {SYNC}\nouter_steps = {OUTER}\n" in run
    return run.replace('"python"', f'"{TORCHTITAN_PYTHON}"') + TEST_SETTINGS


def test_a_torchtitan_not_installed_or_not_tested_is_refused_saying_which_to_install(
    tmp_path, monkeypatch
):
    assert importlib.util.find_spec("torchtitan") is None  # it has its own environment
    with pytest.raises(TorchtitanVersionError, match=re.escape(
        "torchtitan is not installed: pip install 'diloco-anywhere[torchtitan]' "
        "(torchtitan==0.3.0)"
    )):  # fmt: skip
        check_version()
    metadata = tmp_path / "torchtitan-0.4.0.dist-info"  # an installed torchtitan 0.4.0
    metadata.mkdir()
    (metadata / "METADATA").write_text("Metadata-Version: 2.1\nName: torchtitan\nVersion: 0.4.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TorchtitanVersionError, match=re.escape(
        "torchtitan 0.4.0 is installed; diloco-anywhere runs torchtitan 0.3.0 (the versions "
        "its trainer and CPU changes were tested with): pip install torchtitan==0.3.0"
    )):  # fmt: skip
        check_version()
    assert TorchtitanVersionError.exit_code in NOT_RETRIED


REFUSED = {
    "the job's config builds torchtitan.experiments.torchft.trainer.FaultTolerantTrainer; a "
    "replica trains torchtitan's core Trainer": [
        "--module", "torchft.llama3", "--config", "llama3_torchft_debugmodel",
    ],
    "parallelism.pipeline_parallel_degree = 2: pipeline parallelism splits the model": [
        "--module", "llama3", "--config", "llama3_debugmodel",
        "--parallelism.pipeline_parallel_degree", "2", "--training.disable_cuda_graphs",
    ],
}  # fmt: skip
# Each job through the replica's own main, in one process of torchtitan's environment (one
# import of torchtitan for both): its exit code and what it printed, on an 'ended' line each.
REFUSING = """
import contextlib, io, json, sys
from diloco_anywhere.training.torchtitan.__main__ import main
for job in json.loads(sys.argv[1]):
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        try:
            main(job)
            code = 0
        except SystemExit as end:
            code = end.code
    print("ended", json.dumps([code, said.getvalue()]))
"""


@pytest.mark.integration
@needs_torchtitan
def test_a_job_that_cannot_be_a_replica_is_refused_before_it_starts_not_retried(tmp_path):
    (tmp_path / "run.toml").write_text('[run]\nname = "refused"\nstore = "store"\n')
    ran = subprocess.run(
        [TORCHTITAN_PYTHON, "-c", REFUSING, json.dumps(list(REFUSED.values()))],
        cwd=tmp_path, env={**os.environ, "DILOCO_CONFIG": str(tmp_path / "run.toml")},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    ends = [json.loads(line[6:]) for line in ran.stdout.splitlines() if line.startswith("ended ")]
    for refusal, (code, said) in zip(REFUSED, ends, strict=True):
        assert code == EXIT_BAD_CONFIG, said
        assert f"error: {refusal}" in said
    assert not (tmp_path / "store").exists()  # nothing joined the run


@pytest.fixture(scope="module")
def titan_run(hf_corpus, tmp_path_factory):
    """The run, launched once with ``--restart-on-failure``, and its folder: every test below
    asserts on it. Once the first checkpoint is committed, the replica that wrote it is
    SIGKILLed (its entrypoint and its trainer: the job's process group); the launch restarts
    it and it heals. Meanwhile the other replica is frozen, so that the run cannot end first
    (every round needs both)."""
    folder = tmp_path_factory.mktemp("titan")
    shutil.copytree(DEBUG_ASSETS, folder / "tokenizer")  # the template's: bytes, config.json
    _, data = hf_corpus
    (folder / "documents").mkdir()
    shutil.copy(data, folder / "documents" / "data.jsonl")
    (folder / "run.toml").write_text(docs_run())
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.setenv("HF_DATASETS_CACHE", str(folder / "datasets-cache"))
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


@pytest.mark.integration
@needs_torchtitan
def test_a_torchtitan_run_trains_one_model_heals_a_killed_replica_and_exports(
    titan_run, monkeypatch
):
    """Every fact of the one launch (one test: xdist would give each worker running a test of
    this module a launch of its own)."""
    monkeypatch.chdir(titan_run)
    rows = statuses("run.toml")
    assert {(row["state"], row["outer_step"]) for row in rows.values()} == {("done", OUTER)}
    assert {row["own_data"] for row in rows.values()} == {None}  # [task] data: the run's loader
    metrics = run_metrics(load_config("run.toml")).read()
    _one_model_at_each_outer_step(metrics)
    _the_killed_replica_healed_from_the_checkpoint(metrics)
    _each_unit_of_the_data_trained_once(Store(str(titan_run / "store")))
    assert diloco("export", "exported", "--config", "run.toml").exit_code == 0
    exported = load_file("exported/model.safetensors")  # the model's own names, no wrapper's
    assert "layers.0.attention.qkv_linear.wqkv.weight" in exported
    _the_export_in_hugging_face_s_layout_loads_and_predicts(titan_run)


def _the_export_in_hugging_face_s_layout_loads_and_predicts(folder: Path) -> None:
    """``hf_export`` with the job's own arguments, in torchtitan's environment; the model
    config.json the job's hf_assets_path holds (a download of a Hugging Face model has it;
    for the debug model, the one the template's projects ship: torchtitan's dims, RoPE theta
    and "llama" scaling, RMSNorm's eps) copied beside the weights. transformers then loads it
    with no missing or unexpected weight, and it predicts the run's text about as well as the
    run's best steps did (at these sizes RoPE hardly moves the loss: torchtitan's converter
    owns the rotary permutation, and this checks the weights it is given)."""
    job = load_config(folder / "run.toml").task.command[3:]  # after python -m <module>
    converted = subprocess.run(
        [TORCHTITAN_PYTHON, "-m", "diloco_anywhere.training.torchtitan.hf_export",
         "exported", "hf", *job],
        cwd=folder, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert converted.returncode == 0, converted.stderr
    model, info = LlamaForCausalLM.from_pretrained(folder / "hf", output_loading_info=True)
    assert [info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")] == [
        set(), set(), set()
    ]  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(folder / "hf")
    text = (folder / "documents" / "data.jsonl").read_text().splitlines()[:8]
    ids = tokenizer(" ".join(json.loads(line)["text"] for line in text), return_tensors="pt")
    with torch.no_grad():
        loss = model(ids.input_ids[:, :64], labels=ids.input_ids[:, :64]).loss.item()
    trained = min(line.loss for r in run_metrics(load_config(folder / "run.toml")).read().values()
                  for line in r.steps)  # fmt: skip
    assert loss < trained + 1.0, (loss, trained)  # untrained: about 7.6, ln(2048)


def _one_model_at_each_outer_step(metrics) -> None:
    committed = {
        (sync.outer_step, sync.fingerprint)
        for replica in metrics.values()
        for sync in replica.syncs
        if sync.committed
    }
    assert sorted(step for step, _ in committed) == list(range(1, OUTER + 1))
    for replica in metrics.values():  # torchtitan's logged loss, with its lr and grad norm
        assert set(replica.steps[0].values) == {"lr", "grad_norm"}
        assert replica.steps[-1].loss < replica.steps[0].loss


def _the_killed_replica_healed_from_the_checkpoint(metrics) -> None:
    [killed] = [name for name, replica in metrics.items() if replica.incarnations == [0, 1]]
    healed = [e for e in metrics[killed].events_by_incarnation[1] if e.event == "healed"]
    assert "healed from checkpoint" in healed[0].detail
    [other] = set(metrics) - {killed}  # trained on, every step logged once
    assert [line.step for line in metrics[other].steps] == list(range(1, SYNC * OUTER + 1))


def _each_unit_of_the_data_trained_once(store: Store) -> None:
    claims = Claims(store, RunLayout("titan"), contributor("judge", 0), 2).every_claim()
    trained = sorted(claim.unit for claim, outcome in claims if outcome == "trained")
    assert trained == list(range(2 * OUTER))  # 2 replicas x 4 rounds, each unit once
