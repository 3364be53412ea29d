"""Small runs of local replicas, driven through the ``diloco`` CLI as a user would."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from typer.testing import CliRunner

from diloco_anywhere.backends.local import zombie
from diloco_anywhere.cli import app
from diloco_anywhere.config import load_config
from diloco_anywhere.launching.start.launch import run_metrics

RUN_TOML = """
[run]
name = "t"
store = "store"
replicas = {replicas}
min_replicas = 2
[diloco]
sync_every = 5
outer_steps = {outer_steps}
codec = "fp32"
inner_lr = 3e-3
[sync]
grace = 2.0
timeout = 60.0
lease_period = 1.0
[keep]
backoff = 0.5
[task]
log_every = 1
eval_every = 2
[task.options]
preset = "tiny"
batch_size = 4
corpus_bytes = 300000
"""


def diloco(*args: str):
    return CliRunner().invoke(app, list(args))


def statuses(config: str) -> dict[str, dict]:
    result = diloco("status", "--config", config, "--json")
    assert result.exit_code == 0, result.output
    return {row["replica"]: row for row in json.loads(result.stdout)}


def as_streaming(config: str) -> str:
    """The run as Streaming DiLoCo: two fragments, each synced every 3 inner steps in turn,
    evaluated at every outer step."""
    path = Path(config)
    text = path.read_text().replace("sync_every = 5", "sync_every = 6\nfragments = 2")
    path.write_text(text.replace("eval_every = 2", "eval_every = 1"))
    return config


def evaluated_losses(config: str) -> dict[int, set[float]]:
    """Every replica's held-out loss at each evaluated outer step."""
    losses: dict[int, set[float]] = {}
    for metrics in run_metrics(load_config(config)).read().values():
        for sync in metrics.syncs:
            if sync.eval_loss is not None:
                losses.setdefault(sync.outer_step, set()).add(sync.eval_loss)
    return losses


def kill_all(config: str) -> None:
    state = json.loads(Path(".diloco/t/launch.json").read_text())
    for handle in state["replicas"]:
        os.kill(handle["job"]["pid"], signal.SIGKILL)
    for handle in state["replicas"]:
        wait_gone(handle["job"]["pid"])


def wait_gone(pid: int, seconds: float = 60.0) -> None:
    """Until process ``pid`` has ended and been reaped (by whichever process started it)."""
    deadline = time.monotonic() + seconds
    while Path(f"/proc/{pid}").exists() and not zombie(pid):
        assert time.monotonic() < deadline, f"process {pid} still runs"
        time.sleep(0.05)


SECRETS = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"]

HF_JOBS = f"""
[image]
ref = "ghcr.io/acme/run:1"
[backends.hf_jobs]
flavor = "a100-large"
timeout = "2d"
attempts = 2
secrets = {json.dumps(SECRETS)}
"""


def write_run(
    tmp_path, store: str, replicas: int = 2, outer_steps: int = 2, timeout: str = "2d"
) -> str:
    text = RUN_TOML.format(replicas=replicas, outer_steps=outer_steps).replace(
        'store = "store"', f'store = "{store}"'
    )
    (tmp_path / "run.toml").write_text(text + HF_JOBS.replace('"2d"', f'"{timeout}"'))
    return str(tmp_path / "run.toml")


def wait_for_starts(config, replica: str, count: int, seconds: float = 120.0) -> list[str]:
    """The details of ``replica``'s "started" events, once it has ``count`` of them."""
    deadline = time.monotonic() + seconds
    while True:
        metrics = run_metrics(config).read().get(replica)
        starts = [e.detail for e in metrics.events if e.event == "started"] if metrics else []
        if len(starts) >= count:
            return starts
        assert time.monotonic() < deadline, starts
        time.sleep(0.5)


K8S = '\n[backends.k8s]\nsecret = "store"\ngpus_per_pod = 0\n'


def replica_logs(folder: Path, run: str) -> str:
    """Every replica's log of run ``run`` launched in ``folder`` (all its ranks' output,
    torchrun's included): a rank that failed says why only there."""
    logs = sorted((Path(folder) / ".diloco" / run / "logs").glob("*.log"))
    return "".join(f"\n--- {log.name}\n{log.read_text()[-6000:]}" for log in logs)
