"""Rounds paced by time (``[diloco] pace = "time"``, ``training/pacing/pace.py``), as a user runs
them: two local replicas, one ten times slower per step (``bench/tools/slowed_task.py`` pads its
steps), through ``diloco launch``. The slow one trains fewer steps a round, the fast one its
``sync_every``, every round seals with both, and the run's data is still trained once; and two of
equal speed, one slowed mid-run, re-paced within two rounds."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from diloco_anywhere.config import load_config
from diloco_anywhere.launching.start.launch import run_metrics
from diloco_anywhere.launching.watch.report import data_coverage
from diloco_anywhere.training.pacing.pace import LAG, REGIME, moving_step_seconds
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
entrypoint = "diloco_anywhere.bench.tools.slowed_task:build"
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


SLOWED_AFTER = 60  # replica 0's own inner steps before it slows 4x: about three rounds


@pytest.mark.integration
def test_a_replica_slowed_mid_run_is_re_paced_within_two_rounds(
    tmp_path: Path, monkeypatch
) -> None:
    """Replica 0 of two alike becomes 4x slower after its 60th step. From the first round its
    measured step time shows it (taken whole as new hardware), the round two later trains
    exactly what fits the round at that step time, as every replica's sealed paces decide it:
    recomputed here from both replicas' sync lines, so the machine's load (which moves every
    step time) cannot make the check pass or fail; and that is far fewer steps."""
    monkeypatch.chdir(tmp_path)
    slowed = f"speeds = [1.0, 1.0]\nslowdown = [0, {SLOWED_AFTER}, 4]"
    run_toml = RUN_TOML.format(fragments="").replace("outer_steps = 5", "outer_steps = 10")
    (tmp_path / "run.toml").write_text(run_toml.replace("speeds = [1.0, 0.1]", slowed))
    result = diloco("launch", "--config", "run.toml", "--fresh")
    assert result.exit_code == 0, result.output
    config = load_config(tmp_path / "run.toml")
    metrics = run_metrics(config).read()
    mine, theirs = metrics["local-0"].syncs, metrics["local-1"].syncs
    assert all(s.committed and s.participants == 2 for s in mine + theirs)
    assert [s.round for s in mine] == [s.round for s in theirs] == list(range(10))
    paces = [(s.round_steps, s.step_seconds) for s in mine]
    measured = [s.step_seconds for s in mine]
    figures = list(itertools.accumulate(measured, moving_step_seconds))
    # the other's pace is a moving figure too, of the paces it sealed with (``Pacer.decide``)
    their_figures = list(itertools.accumulate((s.step_seconds for s in theirs),
                                              moving_step_seconds))  # fmt: skip
    trained = list(itertools.accumulate(s.round_steps for s in mine))
    first_slow = next(r for r, steps in enumerate(trained) if steps > SLOWED_AFTER)
    taken = next(r for r in range(max(1, first_slow), 10)
                 if measured[r] >= REGIME * figures[r - 1])  # fmt: skip
    assert taken in (first_slow, first_slow + 1), paces  # a few slow steps blend in first
    assert taken + LAG < 10, paces
    length = config.diloco.round_steps * min(figures[taken], their_figures[taken])
    planned = config.diloco.steps_to_fit(length, figures[taken])
    assert mine[taken + LAG].round_steps == planned, (taken, paces, their_figures)
    # slower than the other by the ratio the machine measured (4x, less where the load slowed
    # the other too): as many fewer steps, whatever the load
    slower = figures[taken] / their_figures[taken]
    assert planned <= config.diloco.round_steps / slower + 1, (taken, paces, their_figures)
