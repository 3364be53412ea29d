"""``diloco bench convergence``: DiLoCo against data parallel at equal tokens, as a study.

A fair comparison needs more than one pair of runs (arXiv 2311.08105 section 4; arXiv
2503.09799 on how the best outer learning rate moves with the replicas M and the sync
interval H):

- **a warm start**: one model trained alone for ``warm_start`` steps (plain AdamW), then every
  run from it, as the DiLoCo paper starts from a pretrained checkpoint (``[task] init_from``);
- **the baseline per replica count and seed**: DDP over gloo with N processes, the same
  per-replica batch, AdamW and inner steps, so the same tokens. With N = 1 it is plain AdamW,
  the control the M = 1 DiLoCo runs are held to;
- **a sweep**: every combination of codec, replicas, H, outer learning rate and momentum, for
  every seed, at one token budget (``steps`` inner steps per replica: H x outer steps); a
  codec may bring its own outer step (``sparse:outer_lr=1:outer_momentum=0``, SparseLoCo's),
  which replaces the swept rates for its runs;
- **curves**: the held-out loss at every outer step of DiLoCo (its own metrics) and every H
  steps of the baseline, against the tokens all replicas trained on, in one PNG.

Every run is a real one (local replica processes, a local store, torchft's DiLoCo), and every
number in the result is measured in this one invocation.
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from diloco_anywhere.backends.local import threads_per_replica
from diloco_anywhere.bench.tools.processes import worker_context
from diloco_anywhere.bench.train import (
    Progress,
    results_of,
    run_diloco,
    wall_seconds,
)
from diloco_anywhere.config import RunConfig, describe_codec, parse_codec, with_changes
from diloco_anywhere.launching.cost.traffic import fragment_sizes
from diloco_anywhere.launching.watch.report import summarize
from diloco_anywhere.task import Task, TaskContext, build_task
from diloco_anywhere.training.builders import SINGLE_PROCESS, task_context
from diloco_anywhere.training.loop import backward_batch, before_inner_step
from diloco_anywhere.training.state.warm_start import warm_start

Curve = list[tuple[int, float]]  # (tokens of all replicas, held-out loss)


@dataclass(frozen=True)
class Study:
    """What to compare: every combination of the lists, for every seed, at ``steps`` inner
    steps per replica, from a model trained alone for ``warm_start`` steps (0: from scratch)."""

    replicas: tuple[int, ...] = (4,)
    sync_every: tuple[int, ...] = (50,)
    outer_lr: tuple[float, ...] = (0.7,)
    outer_momentum: tuple[float, ...] = (0.9,)
    fragments: tuple[int, ...] = (1,)
    fragment_delay: int = 0
    seeds: tuple[int, ...] = (0,)
    steps: int = 500
    warm_start: int = 0
    # ``--codec`` specs (``config.parse_codec``), each with its own outer step if it names
    # one (``codec_outer_step``)
    codecs: tuple[str, ...] = ("int8",)

    def check(self) -> None:
        for h in self.sync_every:
            if self.steps % h:
                raise ValueError(f"steps ({self.steps}) must be a multiple of every H ({h})")
        for spec in self.codecs:
            codec_outer_step(spec)

    def runs(self) -> list[dict[str, Any]]:
        """Every DiLoCo run's settings."""
        names = ("codec", "replicas", "sync_every", "fragments", "outer_lr", "outer_momentum",
                 "seed")  # fmt: skip
        runs = []
        for spec in self.codecs:
            _, outer = codec_outer_step(spec)
            product = itertools.product(
                [spec], self.replicas, self.sync_every, self.fragments,
                [outer["outer_lr"]] if "outer_lr" in outer else self.outer_lr,
                [outer["outer_momentum"]] if "outer_momentum" in outer else self.outer_momentum,
                self.seeds,
            )  # fmt: skip
            runs += [dict(zip(names, values, strict=True)) for values in product]
        return runs


OUTER_KEYS = ("outer_lr", "outer_momentum")


def codec_outer_step(spec: str) -> tuple[str, dict[str, float]]:
    """A study's codec spec without its outer step, and that step: ``sparse:outer_lr=1`` is
    ``("sparse", {"outer_lr": 1.0})``; the rest is run.toml's (``config.parse_codec``)."""
    kept, outer = [], {}
    for setting in spec.split(":"):
        key, _, value = setting.partition("=")
        if key not in OUTER_KEYS:
            kept.append(setting)
            continue
        try:
            outer[key] = float(value)
        except ValueError:
            raise ValueError(f"codec {spec!r}: {key} must be a number") from None
    codec = ":".join(kept)
    parse_codec(codec)
    return codec, outer


def _context(config: RunConfig, rank: int, world: int, steps: int) -> TaskContext:
    """What a benchmark's own training loop builds the task with: the share of the run's data
    of replica ``rank`` of ``world`` (fixed: no bucket to claim in), prepared into the run's
    store; ``steps`` is the run's length, over which a task's learning-rate schedule runs (the
    HF task's cosine), exactly as a replica's task is told its run's inner steps."""
    sized = with_changes(config, run__replicas=world, run__min_replicas=1)
    return replace(task_context(sized, rank, SINGLE_PROCESS), total_steps=steps)


def _train_alone(config: RunConfig, steps: int, path: str, results: Any) -> None:
    """The warm start: one model, plain AdamW, ``steps`` batches; saved as safetensors."""
    task = build_task(
        config.task.entrypoint,
        _context(config, 0, 1, steps),
    )
    optimizer = torch.optim.AdamW(
        task.model.parameters(), lr=config.diloco.inner_lr,
        weight_decay=config.diloco.inner_weight_decay,
    )  # fmt: skip
    _steps(task, task.model, optimizer, config, steps, evaluate_every=0)
    save_file(task.model.state_dict(), path)
    results.put(task.evaluate(task.model) if task.evaluate else float("nan"))


def _steps(
    task: Task,
    model: torch.nn.Module,
    optimizer: Any,
    config: RunConfig,
    steps: int,
    evaluate_every: int,
) -> list[tuple[int, float]]:
    """``steps`` training steps as a replica's inner steps are taken (the task's
    micro-batches, clipping and learning-rate schedule: ``loop.backward_batch`` and
    ``before_inner_step``); the held-out loss every ``evaluate_every`` steps (0: never), by
    step."""
    batches, curve = task.batches(0), []
    for step in range(1, steps + 1):
        optimizer.zero_grad(set_to_none=True)
        backward_batch(task, model, next(batches))
        before_inner_step(task, optimizer, config.diloco.inner_lr, step - 1)
        optimizer.step()
        if evaluate_every and step % evaluate_every == 0 and task.evaluate:
            curve.append((step, task.evaluate(task.model)))
    return curve


def _baseline_rank(
    rank: int, world: int, init: str, config: RunConfig, steps: int, every: int, results: Any
) -> None:
    """One process of the data-parallel baseline (DDP over gloo; alone when ``world`` is 1)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(threads_per_replica(world))  # as the DiLoCo run's replicas get
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    task = build_task(
        config.task.entrypoint,
        _context(config, rank, world, steps),
    )
    if config.task.init_from:
        warm_start(task.model, config.task.init_from)
    model = DistributedDataParallel(task.model)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.diloco.inner_lr, weight_decay=config.diloco.inner_weight_decay
    )
    curve = _steps(task, model, optimizer, config, steps, every if rank == 0 else 0)
    parameters = sum(p.numel() for p in task.model.parameters())
    tokens = task.tokens_per_batch * world
    results.put((rank, [(step * tokens, loss) for step, loss in curve], parameters))
    dist.destroy_process_group()


def run_baseline(config: RunConfig, steps: int, every: int, folder: Path) -> dict[str, Any]:
    """Data parallel over ``config.run.replicas`` processes at ``steps`` steps each, on the
    data a DiLoCo run of as many replicas trains (prepared into a store in ``folder``)."""
    config = with_changes(config, run__store=str(folder / "baseline-store"))
    world, context = config.run.replicas, worker_context()
    results, init = context.Queue(), str(folder / f"ddp-init-{world}-{config.run.seed}")
    processes = [
        context.Process(target=_baseline_rank, args=(r, world, init, config, steps, every, results))
        for r in range(world)
    ]
    outcomes = sorted(results_of(processes, results))
    _, curve, parameters = outcomes[0]
    return {
        "eval_loss": curve[-1][1] if curve else float("nan"),  # a task without evaluate
        "curve": curve,
        "parameters": parameters,
        "bytes_per_replica": 2 * (world - 1) / world * 4 * parameters * steps,  # ring, fp32
    }


def _warm_start(
    config: RunConfig, study: Study, folder: Path, progress: Progress
) -> tuple[str, float] | None:
    """The warm-start model's file and held-out loss (None: the study starts from scratch)."""
    if not study.warm_start:
        return None
    progress(f"warm start: one model, {study.warm_start} steps")
    config = with_changes(config, run__store=str(folder / "warm-start-store"))
    context, path = worker_context(), str(folder / "warm-start.safetensors")
    results = context.Queue()
    process = context.Process(target=_train_alone, args=(config, study.warm_start, path, results))
    (eval_loss,) = results_of([process], results)
    return path, eval_loss


def _diloco_curve(metrics: dict) -> Curve:
    """Held-out loss against the tokens of all replicas, at every evaluated outer step."""
    replica = min(metrics.values(), key=lambda m: m.replica)
    return [
        (sync.tokens * len(metrics), sync.eval_loss)
        for sync in replica.syncs
        if sync.committed and sync.eval_loss is not None
    ]


def run_study(config: RunConfig, study: Study, progress: Progress) -> dict[str, Any]:
    """Every run of ``study``, its baselines, and how each DiLoCo run compares."""
    study.check()
    for index, settings in enumerate(study.runs()):  # run.toml's own rules, before any run
        _diloco_config(config, study, settings, f"study-{index}")
    if config.task.init_from:  # every run starts in a folder of its own
        config = with_changes(config, task__init_from=config.resolve(config.task.init_from))
    result: dict[str, Any] = {
        "study": asdict(study),
        "task": dict(config.task.options),
        "runs": [],
        "baselines": [],
    }
    with tempfile.TemporaryDirectory(prefix="diloco-study-") as name:
        folder = Path(name)
        warm = _warm_start(config, study, folder, progress)
        if warm is not None:
            config = with_changes(config, task__init_from=warm[0])
            result["warm_start_eval_loss"] = warm[1]
        baselines = {}
        for replicas, seed in itertools.product(study.replicas, study.seeds):
            progress(f"data parallel: {replicas} x {study.steps} steps, seed {seed}")
            run = with_changes(
                config, run__replicas=replicas, run__min_replicas=replicas, run__seed=seed
            )
            baseline = run_baseline(run, study.steps, min(study.sync_every), folder)
            baselines[replicas, seed] = baseline
            result["baselines"].append({"replicas": replicas, "seed": seed, **baseline})
        for index, settings in enumerate(study.runs()):
            baseline = baselines[settings["replicas"], settings["seed"]]
            run = _diloco_config(config, study, settings, f"study-{index}")
            result["runs"].append(_diloco_run(run, settings, baseline, folder, progress))
    return result


def _diloco_config(
    config: RunConfig, study: Study, settings: dict[str, Any], name: str
) -> RunConfig:
    """One DiLoCo run of the study: its settings, evaluated at every outer step. Momentum 0
    is plain SGD (Nesterov needs momentum); any other keeps the run.toml's Nesterov choice.
    The replicas save no own state: the study weighs the exchange's bytes against data
    parallel's, and a restart's insurance is neither."""
    replicas, h, momentum = settings["replicas"], settings["sync_every"], settings["outer_momentum"]
    codec, sparse = parse_codec(codec_outer_step(settings["codec"])[0])
    return with_changes(
        config, run__name=name, run__replicas=replicas, run__min_replicas=replicas,
        run__seed=settings["seed"], diloco__sync_every=h, diloco__outer_steps=study.steps // h,
        diloco__fragments=settings["fragments"], diloco__fragment_sync_delay=study.fragment_delay,
        diloco__codec=codec, diloco__sparse=sparse.model_dump(),
        diloco__outer_lr=settings["outer_lr"], diloco__outer_momentum=momentum,
        diloco__outer_nesterov=config.diloco.outer_nesterov and momentum > 0, task__eval_every=1,
        checkpoint__own_state=False,
    )  # fmt: skip


def _diloco_run(
    run: RunConfig,
    settings: dict[str, Any],
    baseline: dict[str, Any],
    folder: Path,
    progress: Progress,
) -> dict[str, Any]:
    """Run it; its result against its baseline's."""
    replicas = settings["replicas"]
    run_folder = folder / run.run.name
    run_folder.mkdir()
    progress(f"DiLoCo {settings}")
    metrics = run_diloco(run, run_folder, progress)
    summary = summarize(metrics)
    sent = summary.bytes_up_per_replica
    rounds = run.diloco.last_step
    payload = _payload_per_outer_step(run, baseline["parameters"])
    return {
        **settings,
        "codec_label": describe_codec(run.diloco.codec, run.diloco.sparse),
        # one contribution's encoded pseudo-gradient per outer step (every fragment's), and
        # over its fp32 bytes: the codec's own ratio, without the round's records
        "payload_per_outer_step": payload,
        "payload_vs_fp32": payload / (4 * baseline["parameters"]),
        # everything the replica moved (parts, records, leases, metrics), per sync
        "sent_per_sync": sent / rounds,
        "received_per_sync": summary.bytes_down_per_replica / rounds,
        "tokens": summary.tokens,
        "eval_loss": summary.eval_loss,
        "baseline_eval_loss": baseline["eval_loss"],
        "eval_loss_ratio": summary.eval_loss / baseline["eval_loss"],
        "bytes_per_replica": sent,
        "baseline_bytes_per_replica": baseline["bytes_per_replica"],
        "fewer_bytes": baseline["bytes_per_replica"] / sent if replicas > 1 and sent else None,
        "seconds": statistics.fmean(map(wall_seconds, metrics.values())),
        "curve": _diloco_curve(metrics),
    }


def _payload_per_outer_step(run: RunConfig, parameters: int) -> int:
    """The payload bytes of one replica's contribution for every fragment once, as
    ``Round.contribute`` splits it into parts (each part's ~300-byte header aside)."""
    from diloco_anywhere.collective.parts import part_ranges

    config = run.collective_config()
    codec, policy = config.codec, config.round
    return sum(
        codec.payload_nbytes(len(elements))
        for numel in fragment_sizes(parameters, run.diloco.fragments)
        for elements in part_ranges(numel, codec, policy.part_elements, policy.expected_replicas)
    )


def plot_study(result: dict[str, Any], path: Path) -> None:
    """Held-out loss against tokens: each DiLoCo run solid, each baseline dashed."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(8, 5))
    for baseline in (b for b in result["baselines"] if b["curve"]):
        label = f"data parallel N={baseline['replicas']} seed {baseline['seed']}"
        axes.plot(*zip(*baseline["curve"], strict=True), linestyle="--", label=label)
    for run in result["runs"]:
        if run["curve"]:
            label = (
                f"{run['codec_label']} N={run['replicas']} H={run['sync_every']} "
                f"F={run['fragments']} lr {run['outer_lr']} m {run['outer_momentum']} "
                f"seed {run['seed']}"
            )
            axes.plot(*zip(*run["curve"], strict=True), marker=".", label=label)
    axes.set(xlabel="tokens (all replicas)", ylabel="held-out loss")
    axes.set_title("DiLoCo vs data parallel")
    axes.grid(alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize="x-small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
