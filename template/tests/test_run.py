"""This project's own checks: run.toml loads, the task builds and trains, a two-replica DiLoCo
run of a few rounds completes on local processes and a local store, and every platform of
run.toml produces its launch request without touching the network (``--dry-run``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomli_w
import torch
from typer.testing import CliRunner

from diloco_anywhere.cli import app
from diloco_anywhere.config import load_config, validate_config
from diloco_anywhere.task import build_task
from diloco_anywhere.training.builders import SINGLE_PROCESS, task_context

PROJECT = Path(__file__).resolve().parents[1]
PLATFORMS = sorted(load_config(PROJECT / "run.toml").backends) or ["local"]


def test_run_toml_loads() -> None:
    config = load_config(PROJECT / "run.toml")
    assert config.run.replicas >= 1


def test_the_task_builds_and_its_loss_falls(tmp_path) -> None:
    """The task as one replica builds it, its data prepared into a store of its own."""
    data = load_config(PROJECT / "run.toml").model_dump()
    data["run"]["store"] = str(tmp_path / "store")
    data["task"]["options"].update(preset="tiny", batch_size=4, corpus_bytes=200_000)
    config = validate_config(data, "task check")
    task = build_task(config.task.entrypoint, task_context(config, 0, SINGLE_PROCESS))
    optimizer = torch.optim.AdamW(task.model.parameters(), lr=3e-3)
    batches, losses = task.batches(0), []
    for _ in range(30):
        loss = task.loss(task.model, next(batches))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0]


def test_a_two_replica_local_run_completes(tmp_path, monkeypatch) -> None:
    """The smoke run: this run.toml's task on 2 local processes and a local store."""
    monkeypatch.chdir(tmp_path)
    data = load_config(PROJECT / "run.toml").model_dump()
    data["run"].update(store=str(tmp_path / "store"), replicas=2, min_replicas=2)
    data["diloco"].update(sync_every=5, outer_steps=2)
    data["sync"].update(grace=2.0, lease_period=1.0, timeout=60.0)
    data["task"]["options"].update(preset="tiny", batch_size=4, corpus_bytes=200_000)
    data["backends"] = {}
    validate_config(data, "smoke run")  # the same checks a replica makes
    (tmp_path / "smoke.toml").write_text(tomli_w.dumps(data))
    result = CliRunner().invoke(app, ["launch", "--config", "smoke.toml", "--fresh"])
    assert result.exit_code == 0, result.output
    assert "Run summary" in result.stdout


@pytest.mark.parametrize("platform", PLATFORMS)
def test_each_platform_gets_its_launch_request_offline(platform, tmp_path, monkeypatch) -> None:
    """What `diloco launch --dry-run` shows: one spec per replica and the platform's own
    request for each (job bodies, manifests, app settings), with no secret value in it."""
    monkeypatch.chdir(tmp_path)
    config = load_config(PROJECT / "run.toml")
    replicas = config.backends.get(platform, {}).get("replicas", config.run.replicas)
    command = ["launch", "--config", str(PROJECT / "run.toml"), "--backend", platform]
    result = CliRunner().invoke(app, [*command, "--dry-run"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert [spec["platform"] for spec in shown["replicas"]] == [platform] * replicas
    assert shown["submit"][platform]
    if platform != "local":
        assert config.image.ref in result.stdout  # the project image, on every platform
    assert not (tmp_path / ".diloco").exists()  # nothing started, nothing written
