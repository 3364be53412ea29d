"""``diloco bench hetero``: a fleet of unlike replicas, paced by steps and by time.

Replicas are local processes of the built-in GPT task, each one's inner step slowed to its
share of the fastest's pace (``slowed_task.py``). Three real runs of the same replicas:

- ``steps``: every replica ``sync_every`` steps a round (``pace = "steps"``), the round at the
  slowest one's pace;
- ``time``: each as many steps as fit in the round (``pace = "time"``, ``training/pacing/pace.py``);
- ``equal``: as many replicas, all at the fastest's pace: the held-out loss to match;
- ``slowdown`` (if asked): paced by time, one replica slowed some factor after a number of its
  own inner steps (counted, so the round it comes in does not hang on the machine's load), and
  how many rounds it took to be re-paced.

From each run's own metrics: the fleet's throughput against the sum of its replicas' own
(``launching/watch/fleet.py``), the fastest replicas' waiting share, and the held-out loss at equal
total tokens (the run that trained fewer tokens sets the point, the other's loss
interpolated there).
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco_anywhere.bench.train import Progress, bench_config, run_diloco
from diloco_anywhere.config import RunConfig, with_changes
from diloco_anywhere.launching.start.launch import replica_id_of
from diloco_anywhere.launching.watch.fleet import contributed, fleet_throughput, tokens_per_step
from diloco_anywhere.launching.watch.status import waiting_share
from diloco_anywhere.training.pacing.pace import REGIME, moving_step_seconds
from diloco_anywhere.training.records.metrics import ReplicaMetrics

TASK = "diloco_anywhere.bench.tools.slowed_task:build"


@dataclass(frozen=True)
class HeteroBench:
    speeds: tuple[float, ...]
    sync_every: int = 20
    outer_steps: int = 10
    step_seconds: float = 0.2  # a step at speed 1: H of them a round, long against polling
    batch_size: int = 4
    # a fourth run, paced by time: replica ``index`` slowed ``factor`` times after ``after`` of
    # its own inner steps (``(0, 100, 4)``: after 100, five rounds at H = 20)
    slowdown: tuple[int, int, float] | None = None

    def config(
        self, pace: str, speeds: tuple[float, ...], slowdown: tuple[int, int, float] | None = None
    ) -> RunConfig:
        """The run: ``len(speeds)`` local replicas, every round needing all of them, the
        held-out loss at every outer step."""
        replicas = len(speeds)
        options = {"preset": "tiny", "batch_size": self.batch_size, "corpus_bytes": 2_000_000,
                   "speeds": list(speeds), "step_seconds": self.step_seconds,
                   **({"slowdown": list(slowdown)} if slowdown else {})}  # fmt: skip
        return with_changes(
            bench_config(), run__name=f"hetero-{pace}", run__replicas=replicas,
            run__min_replicas=replicas, diloco__sync_every=self.sync_every,
            diloco__outer_steps=self.outer_steps, diloco__codec="fp32", diloco__pace=pace,
            sync__grace=2.0, sync__timeout=300.0, sync__lease_period=1.0, task__entrypoint=TASK,
            task__log_every=5, task__eval_every=1, task__options=options,
        )  # fmt: skip


Curve = list[tuple[float, float]]


def loss_curve(metrics: dict[str, ReplicaMetrics]) -> Curve:
    """(tokens committed so far, held-out loss) at each outer step, from any replica that
    evaluated it (every replica evaluates the same global weights)."""
    tokens: dict[int, float] = {}
    losses: dict[int, float] = {}
    for m in metrics.values():
        for sync in contributed(m.syncs):
            tokens[sync.round] = tokens.get(sync.round, 0.0) + sync.round_steps * tokens_per_step(m)
        losses.update({s.round: s.eval_loss for s in m.syncs if s.eval_loss is not None})
    curve, total = [], 0.0
    for round_ in sorted(tokens):
        total += tokens[round_]
        if round_ in losses:
            curve.append((total, losses[round_]))
    return curve


def loss_at(curve: Curve, tokens: float) -> float:
    """The held-out loss at ``tokens``, linear between the two points around it."""
    for (t0, l0), (t1, l1) in itertools.pairwise(curve):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / (t1 - t0) if t1 > t0 else l1
    return curve[-1][1]


def summarize_run(metrics: dict[str, ReplicaMetrics], speeds: tuple[float, ...]) -> dict[str, Any]:
    """One run's throughput, waiting, steps per round and loss curve."""
    waiting = {  # from the second sync: the first round waits for every replica's start-up
        replica: waiting_share(m.syncs[1:]) for replica, m in sorted(metrics.items())
    }
    fastest = [replica_id_of("local", k) for k, speed in enumerate(speeds) if speed == max(speeds)]
    fast = [share for replica in fastest if (share := waiting.get(replica)) is not None]
    throughput = fleet_throughput(metrics)
    return {
        **(throughput.as_dict() if throughput else {}),
        "waiting": waiting,
        "fast_waiting": max(fast, default=None),
        "round_steps": {r: [s.round_steps for s in m.syncs] for r, m in sorted(metrics.items())},
        "curve": loss_curve(metrics),
    }


SLOWED = 2.0  # a round's step time this many times the earlier rounds' median: it slowed
# a round's steps at most this share of the round before the slowdown's: re-paced (a noisy
# measurement moves them by a unit or two, a slowdown of 2x or more by half or more)
REPACED = 0.75


def repaced(metrics: ReplicaMetrics) -> dict[str, int | None] | None:
    """The round a replica slowed down in, and how many rounds later it first trained
    markedly fewer steps than in the round before it (at most ``REPACED`` times as many;
    None: never); None if it never slowed.

    It slowed in the first round whose step time measured more than ``SLOWED`` times the
    median of the rounds before it; or, where the slowdown came part-way through the round
    before that one and the pace already took that round's step time whole (``REGIME`` times
    its moving figure, rebuilt from the rounds' step times as ``training/pacing/pace.py`` keeps it),
    in that one. Counted from the first round the pace took as slow, a replica re-paced by the
    plan two rounds on reads 2 whether its slowdown came at a round's start or in its middle."""
    paced = [(s.round, s.step_seconds, s.round_steps) for s in metrics.syncs if s.step_seconds]
    figures = list(itertools.accumulate((t for _, t, _ in paced), moving_step_seconds))

    def taken_whole(k: int) -> bool:  # its pace jumped to round k's slower step time
        return paced[k][1] >= REGIME * figures[k - 1]

    for k in range(1, len(paced)):
        if paced[k][1] > SLOWED * statistics.median(seconds for _, seconds, _ in paced[:k]):
            first = k - 1 if k >= 2 and taken_whole(k - 1) else k
            slowed, before = paced[first][0], paced[first - 1][2]
            fewer = next((r for r, _, n in paced[first:] if n <= REPACED * before), None)
            return {"slowed_round": slowed, "rounds": None if fewer is None else fewer - slowed}
    return None


def bench_hetero(bench: HeteroBench, progress: Progress) -> dict[str, Any]:
    """The runs, and how the time-paced fleet compares."""
    equal = tuple(max(bench.speeds) for _ in bench.speeds)
    plan = [("steps", "steps", bench.speeds, None), ("time", "time", bench.speeds, None),
            ("equal", "steps", equal, None)]  # fmt: skip
    if bench.slowdown is not None:
        plan.append(("slowdown", "time", bench.speeds, bench.slowdown))
    runs = {}
    with tempfile.TemporaryDirectory(prefix="diloco-hetero-") as folder:
        for name, pace, speeds, slowdown in plan:
            progress(f"{name}: {len(speeds)} replicas at speeds {', '.join(map(str, speeds))}")
            run_folder = Path(folder) / name
            run_folder.mkdir()
            metrics = run_diloco(bench.config(pace, speeds, slowdown), run_folder, progress)
            runs[name] = summarize_run(metrics, speeds)
            if slowdown is not None:
                runs[name]["repaced"] = repaced(metrics[replica_id_of("local", slowdown[0])])
    tokens = min(runs["time"]["curve"][-1][0], runs["equal"]["curve"][-1][0])
    loss_time, loss_equal = (loss_at(runs[name]["curve"], tokens) for name in ("time", "equal"))
    return {
        "speeds": list(bench.speeds), "sync_every": bench.sync_every,
        "outer_steps": bench.outer_steps, "step_seconds": bench.step_seconds, "runs": runs,
        "equal_tokens": tokens, "loss_time": loss_time, "loss_equal": loss_equal,
        "loss_ratio": loss_time / loss_equal,
    }  # fmt: skip
