"""``diloco bench convergence``, ``overlap``, ``throughput``, ``hetero``, ``chaos`` and
``unattended``: benchmarks that train DiLoCo runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from diloco_anywhere.cli.bench.options import JsonOutput, number_list
from diloco_anywhere.cli.common import print_json, progress_display, stdout, user_errors

Replicas = Annotated[int, typer.Option(min=1, max=16, help="Replica processes.")]
SyncEvery = Annotated[int, typer.Option(min=1, help="H: inner steps per outer step.")]
OuterSteps = Annotated[int, typer.Option(min=1, help="Outer steps of each run.")]


def _print_result(result: dict[str, Any], title: str, json_output: bool) -> None:
    if json_output:
        print_json(result)
        return
    table = Table(title=title, show_header=False)
    for key, value in result.items():
        shown = (
            json.dumps(value)
            if isinstance(value, dict)
            else (f"{value:,.4g}" if isinstance(value, float) else str(value))
        )
        table.add_row(key, shown)
    stdout.print(table)


def bench_convergence_command(
    replicas: Annotated[
        str, typer.Option(help="Replica counts, comma-separated; 1 is the M = 1 control.")
    ] = "4",
    sync_every: Annotated[str, typer.Option(help="H values, comma-separated.")] = "50",
    outer_lr: Annotated[str, typer.Option(help="Outer learning rates, comma-separated.")] = "0.7",
    outer_momentum: Annotated[
        str,
        typer.Option(help="Outer momenta, comma-separated; 0 is plain SGD, any other Nesterov."),
    ] = "0.9",
    fragments: Annotated[
        str,
        typer.Option(help="Fragments, comma-separated: 1 is DiLoCo, more is Streaming DiLoCo."),
    ] = "1",
    fragment_delay: Annotated[
        int,
        typer.Option(
            min=0, help="tau: inner steps each fragment's sync overlaps (Streaming DiLoCo)."
        ),
    ] = 0,
    seeds: Annotated[str, typer.Option(help="Seeds (init and data order), comma-separated.")] = "0",
    steps: Annotated[
        int, typer.Option(min=1, help="Inner steps per replica: the token budget of every run.")
    ] = 500,
    warm_start: Annotated[
        int,
        typer.Option(
            min=0,
            help="Steps one model trains alone (plain AdamW) first; every run, DiLoCo "
            "and data parallel, starts from it. 0: from scratch.",
        ),
    ] = 0,
    codec: Annotated[
        list[str],
        typer.Option(
            metavar="CODEC",
            help="The codec of the runs, repeatable: fp32, bf16, int8 or sparse, sparse with "
            "its [diloco.sparse] settings after colons (sparse:density=0.03:bits=4), and any "
            "codec with its own outer step, which replaces --outer-lr and --outer-momentum "
            "for its runs (sparse:outer_lr=1:outer_momentum=0).",
        ),
    ] = ["int8"],  # noqa: B006 (typer reads the default; it is never mutated)
    config_path: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="A run.toml whose task (entrypoint and options, inner optimizer settings) "
            "every run trains; paths in its task options must be absolute (every run starts in "
            "a folder of its own). Default: the built-in GPT of the embedded demo run.",
        ),
    ] = None,
    preset: Annotated[
        str | None,
        typer.Option(help="The built-in GPT's size: tiny (default), small or base (tasks/gpt.py)."),
    ] = None,
    plot: Annotated[
        Path | None, typer.Option(help="Write a PNG of held-out loss against tokens here.")
    ] = None,
    json_output: JsonOutput = False,
) -> None:
    """Compare DiLoCo with synchronous data parallel at equal tokens, over a sweep.

    Every combination of --replicas, --sync-every, --fragments, --outer-lr and
    --outer-momentum runs for every seed, each for --steps inner steps per replica, against
    data parallel (DDP over gloo, the same per-replica batch, AdamW and steps) with as many
    processes and the same seed; with 1 replica that baseline is plain AdamW. Reports each
    run's held-out loss (of the agreed weights: with fragments, every fragment's), its ratio
    to the baseline's, and the bytes each replica sent. Runs take minutes each on 2 cores:
    the runs multiply.
    """
    from diloco_anywhere.bench.convergence import Study, plot_study, run_study
    from diloco_anywhere.bench.train import bench_config
    from diloco_anywhere.config import load_config, with_changes
    from diloco_anywhere.tasks.gpt import PRESETS

    if preset is not None and preset not in PRESETS:
        raise typer.BadParameter(f"{preset!r}: one of {', '.join(PRESETS)}", param_hint="--preset")

    study = Study(
        replicas=tuple(number_list(replicas, int, 1, 16, "replica counts, e.g. 1,4")),
        sync_every=tuple(number_list(sync_every, int, 1, 10**6, "H values, e.g. 25,50")),
        outer_lr=tuple(number_list(outer_lr, float, 1e-6, 10, "rates, e.g. 0.5,0.7")),
        outer_momentum=tuple(number_list(outer_momentum, float, 0, 0.999, "e.g. 0.9")),
        fragments=tuple(number_list(fragments, int, 1, 64, "fragment counts, e.g. 1,2")),
        fragment_delay=fragment_delay,
        seeds=tuple(number_list(seeds, int, 0, 2**31, "seeds, e.g. 0,1")),
        steps=steps, warm_start=warm_start, codecs=tuple(codec),
    )  # fmt: skip
    with user_errors(), progress_display() as status:
        config = load_config(config_path) if config_path else bench_config()
        if preset is not None:
            config = with_changes(config, task__options={**config.task.options, "preset": preset})
        result = run_study(config, study, status)
    if plot is not None:
        plot_study(result, plot)
    if json_output:
        print_json(result)
        return
    stdout.print(_study_table(result))
    if plot is not None:
        stdout.print(f"plot: {plot}")


def _study_table(result: dict[str, Any]) -> Table:
    """One row per DiLoCo run, against its baseline."""
    study = result["study"]
    title = f"DiLoCo vs data parallel, {study['steps']} inner steps per replica"
    if study["warm_start"]:
        title += f", warm start {study['warm_start']} steps"
    if study["fragment_delay"]:
        title += f", fragment delay {study['fragment_delay']} steps"
    table = Table(title=title)
    for column in ("codec", "N", "H", "fragments", "outer lr", "momentum", "seed",
                   "held-out loss", "data parallel", "ratio", "payload/fp32", "fewer bytes",
                   "seconds"):  # fmt: skip
        table.add_column(column, justify="left" if column == "codec" else "right")
    for run in result["runs"]:
        fewer = f"{run['fewer_bytes']:.0f}x" if run["fewer_bytes"] else "-"
        table.add_row(
            run["codec_label"], str(run["replicas"]), str(run["sync_every"]),
            str(run["fragments"]),
            f"{run['outer_lr']:g}",
            f"{run['outer_momentum']:g}", str(run["seed"]), f"{run['eval_loss']:.4f}",
            f"{run['baseline_eval_loss']:.4f}", f"{run['eval_loss_ratio']:.3f}",
            f"1/{1 / run['payload_vs_fp32']:.0f}", fewer,
            f"{run['seconds']:.0f}",
        )  # fmt: skip
    return table


def bench_overlap_command(
    replicas: Replicas = 4,
    sync_every: SyncEvery = 48,
    outer_steps: OuterSteps = 6,
    fragments: Annotated[int, typer.Option(min=2, help="Streaming DiLoCo fragments.")] = 4,
    delay: Annotated[int, typer.Option(min=1, help="tau: inner steps a sync overlaps.")] = 6,
    json_output: JsonOutput = False,
) -> None:
    """Measure sync time exposed to training: blocking syncs vs Streaming DiLoCo."""
    from diloco_anywhere.bench.train import bench_config, bench_overlap

    with user_errors(), progress_display() as status:
        config = bench_config(
            run__replicas=replicas, diloco__sync_every=sync_every, diloco__outer_steps=outer_steps
        )
        result = bench_overlap(config, fragments, delay, status)
    _print_result(result, "Exposed sync time", json_output)


def bench_throughput_command(
    sync_every: SyncEvery = 50,
    outer_steps: OuterSteps = 6,
    repeats: Annotated[int, typer.Option(min=1, help="Alternating runs of each (medians).")] = 3,
    json_output: JsonOutput = False,
) -> None:
    """Measure a DiLoCo replica's inner-loop tokens/s against a plain PyTorch loop."""
    from diloco_anywhere.bench.train import bench_config, bench_throughput

    with user_errors(), progress_display() as status:
        config = bench_config(diloco__sync_every=sync_every, diloco__outer_steps=outer_steps)
        result = bench_throughput(config, repeats, status)
    _print_result(result, "Inner-loop throughput", json_output)


def bench_chaos_command(
    replicas: Replicas = 4,
    sync_every: SyncEvery = 10,
    outer_steps: OuterSteps = 40,
    kills: Annotated[int, typer.Option(min=1, help="Replicas to SIGKILL over the run.")] = 10,
    kill_every: Annotated[int, typer.Option(min=1, help="Committed rounds between kills.")] = 3,
    checkpoint_every: Annotated[
        int, typer.Option(min=1, help="Committed syncs between global checkpoints.")
    ] = 5,
    seed: Annotated[int, typer.Option(help="Chooses the victims.")] = 0,
    json_output: JsonOutput = False,
) -> None:
    """Kill replicas mid-run (SIGKILL) and let the launcher restart them; compare with a
    fault-free run of the same seeds.

    Reports rounds, kills, fingerprint agreement, heals and their time, goodput (a lower
    bound) and the ratio of final held-out losses. Takes a few minutes.
    """
    from diloco_anywhere.bench.chaos import bench_chaos
    from diloco_anywhere.bench.train import bench_config

    with user_errors(), progress_display() as status:
        config = bench_config(
            run__replicas=replicas, run__min_replicas=2, diloco__sync_every=sync_every,
            diloco__outer_steps=outer_steps, checkpoint__every=checkpoint_every,
            sync__grace=2.0, sync__lease_period=1.0, sync__timeout=120.0,
            task__eval_every=outer_steps,
        )  # fmt: skip
        result = bench_chaos(config, kills, kill_every, seed, status)
    _print_result(result, "Chaos: kills, restarts and healing", json_output)


def bench_unattended_command(
    outer_steps: OuterSteps = 55,
    hf_jobs_timeout: Annotated[
        str, typer.Option(help="HF Jobs' timeout: each HF Jobs attempt ends after it.")
    ] = "20s",
    k8s_deadline: Annotated[
        int, typer.Option(min=10, help="Kubernetes' activeDeadlineSeconds for each Job.")
    ] = 90,
    keep_every: Annotated[
        float, typer.Option(min=0.5, help="Seconds between keeper passes (cron's minutes).")
    ] = 3.0,
    json_output: JsonOutput = False,
) -> None:
    """A run launched with --detach on local, HF Jobs and Kubernetes stand-ins and left to
    `diloco keep` alone, while platform time limits end attempts, replicas are SIGKILLed
    and one is frozen until the keeper replaces it (a zombie).

    Reports restarts by reason, passes and seconds for an ended replica to return, goodput
    (a lower bound), fingerprint agreement and the alerts sent. Takes a few minutes.
    """
    from diloco_anywhere.bench.unattended import bench_unattended

    with user_errors(), progress_display() as status:
        result = bench_unattended(outer_steps, hf_jobs_timeout, k8s_deadline, keep_every, status)
    _print_result(result, "Unattended: the keeper alone, on three platforms", json_output)


def hetero_table(result: dict[str, Any]) -> Table:
    speeds = ", ".join(f"{speed:g}" for speed in result["speeds"])
    table = Table(title=f"Mixed hardware: speeds {speeds}, H = {result['sync_every']}, "
                  f"{result['outer_steps']} outer steps")  # fmt: skip
    table.caption = (
        "fleet: tokens of committed contributions a second; own: the sum of each replica's "
        "tokens a step over its step time; fast wait: the fastest replicas' share of time "
        "waiting on syncs; steps/round: each replica's after its first round; loss at "
        f"{result['equal_tokens']:,.0f} tokens (time-paced / equal speed): "
        f"{result['loss_ratio']:.3f}x"
    )
    for column in ("run", "fleet tok/s", "own tok/s", "fleet/own", "fast wait",
                   "steps/round"):  # fmt: skip
        table.add_column(column, justify="right", no_wrap=True)
    slowed = result["runs"].get("slowdown", {}).get("repaced")
    if slowed is not None and slowed["rounds"] is None:
        table.caption += (
            f"; slowed in round {slowed['slowed_round']}, not re-paced before the run ended "
            f"(give more --outer-steps)"
        )
    elif slowed is not None:
        table.caption += (
            f"; slowed in round {slowed['slowed_round']}, re-paced {slowed['rounds']} rounds later"
        )
    for name, run in result["runs"].items():
        steps = [_span(counts[1:]) for _, counts in sorted(run["round_steps"].items())]
        waiting = run["fast_waiting"]
        table.add_row(
            name, f"{run['fleet_tokens_per_second']:,.0f}",
            f"{sum(run['own_tokens_per_second'].values()):,.0f}", f"{run['fleet_over_own']:.2f}",
            "-" if waiting is None else f"{waiting:.0%}",
            " ".join(steps),
        )  # fmt: skip
    return table


def _span(counts: list[int]) -> str:
    """A replica's steps a round after its first: ``20``, or ``6-10`` where they varied."""
    if not counts:
        return "-"
    least, most = min(counts), max(counts)
    return str(least) if least == most else f"{least}-{most}"


def bench_hetero_command(
    speeds: Annotated[
        str,
        typer.Option(
            help="One speed per replica, comma-separated, 1 the fastest (1,1,0.25,0.25: two "
            "replicas four times slower a step)."
        ),
    ] = "1,1,0.25,0.25",
    sync_every: SyncEvery = 20,
    outer_steps: OuterSteps = 10,
    step_seconds: Annotated[
        float,
        typer.Option(
            min=0.001,
            help="What an inner step of speed 1 takes: a round is H of them, long against "
            "the store's polling as a real round of minutes is (0.05: 1 s rounds, where the "
            "polling itself costs a tenth).",
        ),
    ] = 0.2,
    slowdown: Annotated[
        str | None,
        typer.Option(
            metavar="INDEX,STEPS,FACTOR",
            help="A fourth run, paced by time, in which replica INDEX becomes FACTOR times "
            "slower after STEPS of its own inner steps (0,100,4: after 100, five rounds at "
            "H = 20): how many rounds until it is re-paced.",
        ),
    ] = None,
    json_output: JsonOutput = False,
) -> None:
    """Replicas of unlike speed (each inner step slowed to its share): rounds paced by steps
    (every replica sync_every), by time (pace = "time"), and as many replicas all at the
    fastest's speed.

    Reports each run's fleet throughput against the sum of its replicas' own, how long the
    fastest replicas wait, the steps each replica trains a round, and the held-out loss of
    the time-paced fleet at equal total tokens against the equal-speed run. Takes minutes.
    """
    from diloco_anywhere.bench.hetero import HeteroBench, bench_hetero

    parsed = number_list(speeds, float, 0.01, 1.0, "speeds from 0.01 to 1, e.g. 1,1,0.25,0.25")
    slowed = None
    if slowdown is not None:
        numbers = number_list(slowdown, float, 0, 1e6, "INDEX,STEPS,FACTOR: 0,100,4")
        index, after, factor = numbers if len(numbers) == 3 else (-1.0, -1.0, 0.0)
        if not (index.is_integer() and 0 <= index < len(parsed) and after.is_integer()
                and after >= 0 and factor >= 1):  # fmt: skip
            raise typer.BadParameter(f"{slowdown!r}: give INDEX,STEPS,FACTOR: a replica index "
                                     f"below {len(parsed)}, its inner steps before it slows "
                                     f"(a whole number) and a factor of 1 or more, e.g. "
                                     f"0,100,4")  # fmt: skip
        slowed = (int(index), int(after), factor)
    bench = HeteroBench(tuple(parsed), sync_every, outer_steps, step_seconds, slowdown=slowed)
    with user_errors(), progress_display() as status:
        result = bench_hetero(bench, status)
    if json_output:
        print_json(result)
        return
    stdout.print(hetero_table(result))
