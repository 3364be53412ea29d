"""Chaos: replicas SIGKILLed mid-run and restarted. Does the run finish, agree, heal, and learn?

A real run of local replica processes under the launch supervisor (``--restart-on-failure``,
which runs the keeper); every ``kill_every`` committed rounds a random replica that has synced
since it last started is SIGKILLed (no warning, as a preempted spot VM or an evicted pod), and
the keeper restarts it. Every figure comes from the run's own metrics in its bucket:

- agreement: in every round, every replica that committed it reports the same fingerprint of
  the global state it started from;
- healing: every restarted incarnation recorded a ``healed`` event, how long healing took, and
  how long from the kill until the replica contributed to a committed round again;
- goodput: inner steps whose pseudo-gradient reached a committed round, over all inner steps
  run. A killed incarnation's steps since its last sync are unrecorded; each kill is charged a
  full round of them, so the figure is a lower bound.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco_anywhere.bench.train import Progress, local_plan, run_diloco
from diloco_anywhere.config import RunConfig, with_changes
from diloco_anywhere.launching.keep.supervisor import Supervisor
from diloco_anywhere.launching.start.launch import run_metrics, start
from diloco_anywhere.training.records.metrics import ReplicaMetrics

# [keep] backoff, seconds: the time a replica takes to return measures healing, not the wait
CHAOS_BACKOFF = 0.5


@dataclass
class Kill:
    replica: str
    after_round: int  # the newest committed round when it was killed
    time: float  # wall clock, as metrics lines record it


@dataclass
class ChaosRun:
    metrics: dict[str, ReplicaMetrics]
    kills: list[Kill] = field(default_factory=list)


def _newest_committed_round(metrics: dict[str, ReplicaMetrics]) -> int:
    return max((s.round for m in metrics.values() for s in m.syncs if s.committed), default=-1)


def _synced_since(metrics: ReplicaMetrics | None, started: float) -> bool:
    """Whether the replica synced after ``started``: the process started then has healed and
    trains (a process killed before that would test nothing but start-up)."""
    return metrics is not None and any(sync.time > started for sync in metrics.syncs)


def run_with_chaos(
    config: RunConfig,
    folder: Path,
    kills: int,
    kill_every: int,
    seed: int,
    progress: Progress,
    deadline_seconds: float = 3600.0,
) -> ChaosRun:
    """Run ``config`` in ``folder``, SIGKILLing ``kills`` replicas, one per ``kill_every``
    committed rounds, each restarted by the supervisor; return the metrics and the kills."""
    deadline = time.monotonic() + deadline_seconds
    plan = local_plan(with_changes(config, keep__backoff=CHAOS_BACKOFF), folder)
    started = start(plan)  # as `diloco launch` starts a run: recorded in its bucket
    backend = started["local"][0]
    supervisor = Supervisor(plan, started, max_restarts=kills + 1)
    reader, chooser, run = run_metrics(plan.config), random.Random(seed), ChaosRun({})
    last_kill_round, started_at = 0, {}  # pid -> when this loop first saw the process
    while True:
        supervisor.restart_failed()
        ended = all(supervisor.state(handle) != "running" for handle in supervisor.handles)
        if ended and not supervisor.restarting:
            break
        if time.monotonic() > deadline:
            for handle in supervisor.handles:
                backend.stop(handle)
            raise TimeoutError(f"chaos run not done after {deadline_seconds:g}s; stopped it")
        for handle in supervisor.handles:
            started_at.setdefault(handle.job["pid"], time.time())
        run.metrics = reader.read()
        newest = _newest_committed_round(run.metrics)
        if len(run.kills) < kills and newest >= last_kill_round + kill_every:
            victims = [
                handle for handle in supervisor.handles
                if supervisor.state(handle) == "running"
                and _synced_since(run.metrics.get(handle.replica_id), started_at[handle.job["pid"]])
            ]  # fmt: skip
            if victims:
                victim = chooser.choice(victims)
                os.killpg(victim.job["pid"], signal.SIGKILL)  # torchrun and its workers too
                run.kills.append(Kill(victim.replica_id, newest, time.time()))
                last_kill_round = newest
                progress(f"round {newest}: killed {victim.replica_id} "
                         f"({len(run.kills)} of {kills})")  # fmt: skip
        time.sleep(0.25)
    run.metrics = reader.read()
    return run


def fingerprint_disagreements(metrics: dict[str, ReplicaMetrics]) -> dict[int, set[str]]:
    """Rounds whose committing replicas report more than one fingerprint (should be none)."""
    by_round: dict[int, set[str]] = {}
    for replica in metrics.values():
        for sync in replica.syncs:
            if sync.committed:
                by_round.setdefault(sync.round, set()).add(sync.fingerprint)
    return {round_: found for round_, found in by_round.items() if len(found) > 1}


def unhealed_restarts(metrics: dict[str, ReplicaMetrics]) -> list[str]:
    """Restarted incarnations (not a replica's first) without a ``healed`` event."""
    return [
        f"{replica.replica}-{incarnation}"
        for replica in metrics.values()
        for incarnation, events in list(replica.events_by_incarnation.items())[1:]
        if not any(event.event == "healed" for event in events)
    ]


def goodput(metrics: dict[str, ReplicaMetrics], kills: int, batches_per_round: int) -> float:
    """Useful inner steps (in committed rounds this replica contributed to) over all inner
    steps run, charging each kill a full round of unrecorded steps (a lower bound)."""
    syncs = [sync for replica in metrics.values() for sync in replica.syncs]
    useful = sum(sync.committed and sync.contributed for sync in syncs) * batches_per_round
    return useful / ((len(syncs) + kills) * batches_per_round)


def rejoin_seconds(run: ChaosRun) -> list[float]:
    """Per kill: from the SIGKILL to the replica's next contribution to a committed round
    (restart, start-up, heal, and the inner steps of the round it joins)."""
    seconds = []
    for kill in run.kills:
        syncs = run.metrics[kill.replica].syncs
        back = [s.time for s in syncs if s.time > kill.time and s.committed and s.contributed]
        if back:
            seconds.append(min(back) - kill.time)
    return seconds


def final_evaluations(metrics: dict[str, ReplicaMetrics]) -> dict[str, float]:
    """Each replica's held-out loss at the run's last round, where it evaluated one (a replica
    restarted after the last round heals to the final state and has nothing to train)."""
    last = _newest_committed_round(metrics)
    return {
        replica.replica: sync.eval_loss
        for replica in metrics.values()
        for sync in replica.syncs
        if sync.round == last and sync.eval_loss is not None
    }


def final_eval_loss(metrics: dict[str, ReplicaMetrics]) -> float | None:
    evaluations = list(final_evaluations(metrics).values())
    return statistics.fmean(evaluations) if evaluations else None


def chaos_figures(run: ChaosRun, config: RunConfig) -> dict[str, Any]:
    heals = [e.seconds for m in run.metrics.values() for e in m.events if e.event == "healed"]
    rejoins = rejoin_seconds(run)
    batches_per_round = config.diloco.sync_every // config.diloco.fragments
    return {
        "replicas": config.run.replicas,
        "rounds": _newest_committed_round(run.metrics) + 1,
        "kills": len(run.kills),
        "done": sorted(m.replica for m in run.metrics.values() if m.state() == "done"),
        "rounds_with_disagreeing_fingerprints": len(fingerprint_disagreements(run.metrics)),
        "restarts": sum(len(m.incarnations) - 1 for m in run.metrics.values()),
        "restarts_not_healed": len(unhealed_restarts(run.metrics)),
        "heal_seconds_median": statistics.median(heals) if heals else None,
        "heal_seconds_max": max(heals, default=None),
        "rejoin_seconds_median": statistics.median(rejoins) if rejoins else None,
        "rejoin_seconds_max": max(rejoins, default=None),
        "goodput": goodput(run.metrics, len(run.kills), batches_per_round),
        "eval_loss": final_eval_loss(run.metrics),
    }


def bench_chaos(
    config: RunConfig, kills: int, kill_every: int, seed: int, progress: Progress
) -> dict[str, Any]:
    """The same run fault-free and under chaos (same seeds): the chaos figures and the ratio
    of their final held-out losses."""
    with tempfile.TemporaryDirectory(prefix="diloco-bench-") as folder:
        clean, chaos = Path(folder) / "clean", Path(folder) / "chaos"
        clean.mkdir()
        chaos.mkdir()
        progress(f"fault-free: {config.run.replicas} replicas x {config.diloco.outer_steps} rounds")
        baseline = final_eval_loss(run_diloco(config, clean, progress))
        run = run_with_chaos(config, chaos, kills, kill_every, seed, progress)
    figures = chaos_figures(run, config)
    chaos = figures["eval_loss"]
    return {
        **figures,
        "fault_free_eval_loss": baseline,
        "eval_loss_ratio": chaos / baseline if chaos and baseline else None,
    }
