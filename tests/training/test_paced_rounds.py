"""Rounds paced by time (``[diloco] pace = "time"``, ``training/pace.py``), as a user runs them:
two local replicas, one ten times slower per step (``bench/slowed_task.py`` pads its steps), through
``diloco launch``. The slow one trains fewer steps a round, the fast one its ``sync_every``,
every round seals with both, and the run's data is still trained once."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco_anywhere.config import load_config
from diloco_anywhere.launching.launch import run_metrics
from diloco_anywhere.launching.report import data_coverage
from support.runs import diloco

RUN_TOML = """
[run]
name = "paced"
store = "store"
replicas = 2
min_replicas = 2
[diloco]
sync_every = 20
outer_steps = 5
codec = "fp32"
pace = "time"
{fragments}
[sync]
grace = 2.0
timeout = 120.0
lease_period = 1.0
[task]
entrypoint = "diloco_anywhere.bench.slowed_task:build"
log_every = 5
eval_every = 0
[task.options]
preset = "tiny"
batch_size = 4
corpus_bytes = 300000
speeds = [1.0, 0.1]
step_seconds = 0.05
"""


@pytest.mark.integration
@pytest.mark.parametrize("fragments", ["", "fragments = 2"], ids=["diloco", "streaming"])
def test_a_slow_replica_trains_fewer_steps_a_round_and_every_round_seals_with_both(
    tmp_path: Path, monkeypatch, fragments: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text(RUN_TOML.format(fragments=fragments))
    result = diloco("launch", "--config", "run.toml", "--fresh")
    assert result.exit_code == 0, result.output
    config = load_config(tmp_path / "run.toml")
    metrics = run_metrics(config).read()
    fast, slow = metrics["local-0"].syncs, metrics["local-1"].syncs
    reference = config.diloco.round_steps
    assert {sync.round_steps for sync in fast} == {reference}  # the fastest sets the round
    # planned from the rounds before it (two rounds ahead): whole units, fewer than the fast
    # one's however loaded the machine (its steps take 0.5 s more, the fast one's 0.05 s)
    later = [sync.round_steps for sync in slow if sync.round >= 2]
    assert later
    assert all(sync < reference for sync in later), later
    assert all(steps % config.diloco.step_quantum == 0 for steps in later)
    assert all(s.committed and s.participants == 2 for s in fast + slow)
    assert all(sync.step_seconds is not None for sync in fast + slow)
    coverage = data_coverage(config)
    assert coverage is not None
    assert all(epoch.trained_more == 0 for epoch in coverage.epochs), coverage
    trained = sum(epoch.trained_once for epoch in coverage.epochs)
    assert trained == 4 * sum(sync.round_steps for sync in fast + slow)  # 4 sequences a step
