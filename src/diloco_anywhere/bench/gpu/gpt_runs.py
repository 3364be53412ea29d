"""The built-in GPT's runs that the FSDP and compile checks train: one replica, on a device,
its store in a folder of its own; and what they trained, read back from that store."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from diloco_anywhere.bench.gpu.plan import Sizes
from diloco_anywhere.bench.train import local_plan
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import RunConfig, validate_config
from diloco_anywhere.launching.start.launch import run_metrics
from diloco_anywhere.launching.watch.export import (
    GlobalWeights,
    committed_checkpoint,
    global_weights,
)
from diloco_anywhere.training.records.metrics import ReplicaMetrics

log = logging.getLogger(__name__)
CORPUS_BYTES = 2_000_000


def gpt_config(
    device: str, sizes: Sizes, folder: Path, *, outer_steps: int, run: dict[str, Any],
    diloco: dict[str, Any], task: dict[str, Any],
) -> RunConfig:  # fmt: skip
    """One replica of the built-in GPT on ``device`` with run.toml changes per section."""
    data = {
        "run": {"name": "gpu-gpt", "store": "store", "replicas": 1, "min_replicas": 1, **run},
        "diloco": {"sync_every": sizes.gpt_sync_every, "outer_steps": outer_steps,
                   "inner_lr": 3e-3, **diloco},
        "sync": {"timeout": 300.0},
        "task": {"device": device, "log_every": 1, "eval_every": 1,
                 "options": {"preset": sizes.gpt_preset, "batch_size": sizes.gpt_batch,
                             "corpus_bytes": CORPUS_BYTES}, **task},
    }  # fmt: skip
    return validate_config(data, "a gpu check's GPT run", folder / "run.toml")


def run_under_torchrun(config: RunConfig, folder: Path, timeout: float) -> RunConfig:
    """The run's one replica as one rank under ``torchrun`` (a sharded replica's device mesh
    needs its process group even for one rank); the config as written there. Raises with the
    end of its log if it fails."""
    folder.mkdir(parents=True, exist_ok=True)
    plan = local_plan(config, folder)
    spec = plan.specs[0]
    command = spec.command(sys.executable, torchrun=True)
    log_path = folder / "torchrun.log"
    log.info("%s", " ".join(command))
    with log_path.open("wb") as output:
        ended = subprocess.run(
            command, env={**os.environ, **spec.env}, stdin=subprocess.DEVNULL, stdout=output,
            stderr=subprocess.STDOUT, timeout=timeout, check=False, cwd=folder,
        )  # fmt: skip
    if ended.returncode != 0:
        raise RuntimeError(
            f"the replica under torchrun exited {ended.returncode}; its log ends:\n"
            f"{log_path.read_text(errors='replace')[-3000:]}"
        )
    return plan.config


def final_weights(config: RunConfig) -> GlobalWeights:
    """The newest committed checkpoint's global weights, by parameter name."""
    with Store(config.store_url()) as store:
        checkpoint = committed_checkpoint(store, RunLayout(config.run.name), None)
        try:
            return global_weights(config, checkpoint).loaded()
        finally:
            checkpoint.close()


def the_replica(config: RunConfig) -> ReplicaMetrics:
    """The run's one replica's metrics, every incarnation."""
    (metrics,) = run_metrics(config).read().values()
    return metrics


def eval_losses(metrics: ReplicaMetrics) -> list[float]:
    return [sync.eval_loss for sync in metrics.syncs if sync.eval_loss is not None]
