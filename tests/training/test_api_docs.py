"""docs/api.md's examples, run exactly as printed: the page is what users copy."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.image import imread

from diloco_anywhere.bucket.format.layout import RunLayout, contributor
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.data.claims import Claims
from diloco_anywhere.launching.watch.status import OWN_DATA_FIX
from diloco_anywhere.training.checkpoints.catalogue import newest_checkpoints
from diloco_anywhere.training.training import OWN_DATA
from support.docs import example
from support.runs import diloco, statuses

pytestmark = pytest.mark.integration  # every test here starts processes


def _plain_loop(folder: Path) -> None:
    (folder / "train.py").write_text(example("# train.py"))
    (folder / "run.toml").write_text(example("# run.toml", "toml"))


def test_a_plain_loop_is_every_replica_of_diloco_launch(tmp_path, monkeypatch):
    _plain_loop(tmp_path)
    monkeypatch.chdir(tmp_path)
    [command] = example("diloco launch --config run.toml", "bash").splitlines()
    result = diloco(*command.split("#")[0].split()[1:])
    assert result.exit_code == 0, result.output
    rows = statuses("run.toml")
    assert {(row["state"], row["outer_step"]) for row in rows.values()} == {("done", 5)}
    assert all(row["loss"] is not None for row in rows.values())
    assert all(row["own_data"] == OWN_DATA for row in rows.values())  # it draws its own batches
    shown = diloco("status", "--config", "run.toml")
    assert f"local-0, local-1 train on their script's own data: {OWN_DATA_FIX}" in " ".join(
        shown.stdout.split()
    )  # (the console wraps it)
    logs = [(tmp_path / ".diloco" / "plain-loop" / "logs" / f"{r}.log").read_text() for r in rows]
    assert all("trained 5 outer steps" in log for log in logs)
    assert all(row["values"] == {"lr": 0.01} for row in rows.values())
    assert diloco("report", "--config", "run.toml").exit_code == 0
    plot = imread(tmp_path / ".diloco" / "plain-loop" / "report.png")
    assert plot.shape[0] == 7 * 120  # the loss, and a panel for lr under it (inches x dpi)
    # the trackers' example, as printed (W&B offline: no account, no network)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    for line in example("diloco report --config run.toml --tensorboard", "bash").splitlines():
        tracked = diloco(*line.split("#")[0].split()[1:])
        assert tracked.exit_code == 0, tracked.output
    assert sorted(path.name for path in (tmp_path / "tb").iterdir()) == ["local-0", "local-1"]
    assert len(list((tmp_path / "wandb").glob("offline-run-*-plain-loop-local-*"))) == 2


def test_a_plain_loop_trains_as_two_replicas_started_by_hand(tmp_path, monkeypatch):
    _plain_loop(tmp_path)
    commands = example("DILOCO_REPLICA_ID=local-0", "bash").splitlines()[:2]
    replicas = [
        subprocess.Popen(
            [sys.executable, "train.py", "run.toml"], cwd=tmp_path,
            env={**os.environ, "DILOCO_REPLICA_ID": command.split()[0].split("=")[1]},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for command in commands
    ]  # fmt: skip
    outputs = [replica.communicate(timeout=300) for replica in replicas]
    assert [replica.returncode for replica in replicas] == [0, 0], outputs
    assert sorted(out for out, _ in outputs) == [
        "local-0 trained 5 outer steps\n",
        "local-1 trained 5 outer steps\n",
    ]
    monkeypatch.chdir(tmp_path)
    rows = statuses("run.toml")
    assert {(row["state"], row["outer_step"]) for row in rows.values()} == {("done", 5)}
    assert all(row["loss"] is not None for row in rows.values())


def test_a_loop_of_your_own_streams_the_run_s_prepared_corpus(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text").mkdir()
    lines = [f'{{"text": "line {i} of the text, and more words {i * i}"}}' for i in range(400)]
    (tmp_path / "text" / "a.jsonl").write_text("\n".join(lines))
    (tmp_path / "train_stream.py").write_text(example("# train_stream.py"))
    run = example("# run.toml", "toml").replace("train.py", "train_stream.py")
    (tmp_path / "run.toml").write_text(run.replace("[task]", '[task]\ndata = "corpus"'))
    for line in example("diloco data prepare 'text/*.jsonl'", "bash").splitlines():
        words = [word.strip("'") for word in line.split("#")[0].split()]
        result = diloco(*words[1:])
        assert result.exit_code == 0, result.output
    store = Store(str(tmp_path / "store"))
    states = Claims(store, RunLayout("plain-loop"), contributor("judge", 0), 2).states()
    rounds = int(re.search(r"outer_steps = (\d+)", run).group(1))
    assert [state.unit for state in states] == list(range(2 * rounds))
    assert all(state.trained for state in states)
    rows = statuses("run.toml").values()
    assert {(row["state"], row["own_data"]) for row in rows} == {("done", None)}


def test_an_existing_loop_started_and_finished_trains_as_the_with_blocks_do(tmp_path, monkeypatch):
    """``replica.start`` / ``training.steps`` / ``replica.finish`` (no re-indenting) train
    what ``with join()`` / ``with diloco`` / ``training.batches`` train: the same data by step,
    the same global weights, bit for bit; and the printed diff is the script's."""
    script = example("# train_started.py")
    added = [line[1:] for line in example("-for step", "diff").splitlines() if line[:1] == "+"]
    assert all(line in script.splitlines() for line in added)
    checkpoints = []
    for name, form in (("started", script), ("with", example("# train.py"))):
        (tmp_path / name).mkdir()
        _plain_loop(tmp_path / name)
        (tmp_path / name / "train.py").write_text(form)
        monkeypatch.chdir(tmp_path / name)
        result = diloco("launch", "--config", "run.toml")
        assert result.exit_code == 0, result.output
        rows = statuses("run.toml")
        assert {(row["state"], row["outer_step"]) for row in rows.values()} == {("done", 5)}
        store = Store(str(tmp_path / name / "store"))
        checkpoints.append(next(newest_checkpoints(store, RunLayout("plain-loop"))))
    started, with_blocks = checkpoints
    assert started.commit.round == with_blocks.commit.round
    assert started.fingerprint == with_blocks.fingerprint


def test_the_allreduce_example_averages_across_two_processes(tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(example("# allreduce.py"))
    store = tmp_path / "store"
    workers = [
        subprocess.Popen(
            [sys.executable, str(script), f"worker-{k}", str(store)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for k in range(2)
    ]  # fmt: skip
    outputs = [worker.communicate(timeout=300) for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], outputs
    assert sorted(out for out, _ in outputs) == [
        "worker-0 [0.5, 0.5, 0.5, 0.5]\n",
        "worker-1 [0.5, 0.5, 0.5, 0.5]\n",
    ]


def test_torchfts_diloco_built_by_hand_syncs_two_processes_through_the_store(tmp_path):
    script = tmp_path / "own_diloco.py"
    script.write_text(example("# own_diloco.py"))
    workers = [
        subprocess.Popen(
            [sys.executable, str(script), f"worker-{k}", str(tmp_path / "store")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for k in range(2)
    ]  # fmt: skip
    outputs = [worker.communicate(timeout=300) for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], outputs
    lines = sorted(out.split(" ", 1) for out, _ in outputs)
    assert [name for name, _ in lines] == ["worker-0", "worker-1"]
    assert lines[0][1] == lines[1][1]  # the same committed step and the same global weights
    assert lines[0][1].startswith("4 ")  # every sync committed
