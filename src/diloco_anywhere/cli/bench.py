"""``diloco bench ...``: measured numbers (docs/benchmarks.md), never timed tests."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from diloco_anywhere.bucket.codec_names import CODEC_NAMES
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.cli.common import (
    parse_size,
    print_json,
    progress_display,
    stdout,
    user_errors,
)
from diloco_anywhere.standins import STANDINS, standin

if TYPE_CHECKING:
    from diloco_anywhere.bench.wan import WanShape


def _bench_target(
    stack: ExitStack, url: str | None, standin_name: str | None, status: Callable[[str], None]
) -> tuple[str, dict[str, Any]]:
    """The store URL and storage options to measure: given, a stand-in, or a temp folder."""
    if url and standin_name:
        raise typer.BadParameter("give --store or --standin, not both")
    if standin_name:
        status(f"starting the {standin_name} stand-in")
        server = stack.enter_context(standin(standin_name))
        return f"{server.url}/bench", server.storage_options
    return url or stack.enter_context(tempfile.TemporaryDirectory(prefix="diloco-bench-")), {}


def _store_table(result: dict[str, Any]) -> Table:
    size = result["size_bytes"] / 2**20
    table = Table(title=f"Store: {size:.0f} MiB in {result['objects']} objects "
                  f"(median of {result['repeats']})")  # fmt: skip
    for column in ("path", "write MiB/s", "read MiB/s", "write s", "read s"):
        table.add_column(column, justify="left" if column == "path" else "right", overflow="fold")
    for name, row in ((result["url"], result), ("raw file copy", result["raw_copy"])):
        table.add_row(
            name, f"{row['put_mib_s']:.0f}", f"{row['get_mib_s']:.0f}",
            f"{row['put_seconds']:.3f}", f"{row['get_seconds']:.3f}",
        )  # fmt: skip
    requests = result["requests_per_round"]
    table.caption = (
        f"store time / raw time: write {result['put_vs_raw']:.2f}x, read "
        f"{result['get_vs_raw']:.2f}x; requests per round: {requests['puts']} puts, "
        f"{requests['gets']} gets, {requests['retries']} retries"
    )
    return table


def _codec_table(codecs: dict[str, dict[str, float]], numel: int) -> Table:
    table = Table(title=f"Codecs on {numel:,} float32 values (wire path: header + CRC32C)")
    table.caption = "err: relative L2 error on Gaussian and on Student-t(3) values"
    columns = ("codec", "size/fp32", "err Gauss", "err t(3)", "enc GiB/s", "dec GiB/s")
    for column in columns:
        table.add_column(column, justify="left" if column == "codec" else "right")
    for name, row in codecs.items():
        table.add_row(
            name, f"{row['ratio']:.4f}", f"{row['rel_l2_gaussian']:.2e}",
            f"{row['rel_l2_student_t']:.2e}", f"{row['encode_gib_s']:.2f}",
            f"{row['decode_gib_s']:.2f}",
        )  # fmt: skip
    return table


STORE_OPTION = typer.Option(
    "--store",
    help="Store URL to measure: a path, file://, s3://, gs://, az://, hf://buckets/... "
    "(credentials from the environment). Default: a temporary local folder.",
)
STANDIN_OPTION = typer.Option(
    "--standin", help=f"Start a local stand-in server and measure it: {', '.join(STANDINS)}."
)
JsonOutput = Annotated[
    bool, typer.Option("--json", help="Print one JSON object instead of the tables.")
]


bench_app = typer.Typer(
    rich_markup_mode=None,  # plain click help: readable at 80 columns (rich squeezes it)
    help="Benchmarks: measured numbers (docs/benchmarks.md), never timed tests.",
    no_args_is_help=True,
)


@bench_app.command("store")
def bench_store_command(
    store_url: Annotated[str | None, STORE_OPTION] = None,
    standin_name: Annotated[str | None, STANDIN_OPTION] = None,
    size: Annotated[
        int,
        typer.Option(
            parser=parse_size,
            help="Bytes per round (e.g. 64MiB), split into --objects objects; "
            "the codecs run on size/4 float32 values.",
        ),
    ] = "64MiB",  # type: ignore[assignment]
    objects: Annotated[int, typer.Option(min=1, help="Objects per round, sent concurrently.")] = 16,
    repeats: Annotated[int, typer.Option(min=1, help="Rounds to take the median of.")] = 3,
    json_output: JsonOutput = False,
) -> None:
    """Measure store put/get against a raw file copy, and codec speed, size and error.

    Codec error is measured on Gaussian and Student-t(3) tensors.
    """
    from diloco_anywhere.bench.store import bench_codecs, bench_store

    with user_errors(), ExitStack() as stack, progress_display() as status:
        url, options = _bench_target(stack, store_url, standin_name, status)
        store = stack.enter_context(Store(url, storage_options=options))
        result = {
            "store": bench_store(store, size, objects, repeats, status),
            "codecs": bench_codecs(size // 4, repeats, status),
        }
    if json_output:
        print_json(result)
        return
    stdout.print(_store_table(result["store"]))
    stdout.print(_codec_table(result["codecs"], size // 4))


Bandwidth = Annotated[
    int | None,
    typer.Option(
        parser=parse_size,
        help="WAN: bytes/s per connection (e.g. 25MB), through a shaped link per replica "
        "(bench sharded: per rank) in front of --standin s3.",
    ),
]
Latency = Annotated[
    float, typer.Option(min=0, help="WAN: seconds of round trip added to every request.")
]
Link = Annotated[
    int | None,
    typer.Option(
        parser=parse_size,
        help="WAN: bytes/s of each replica's (bench sharded: each rank's) link, both "
        "directions together (default: 8 connections' worth).",
    ),
]


def _wan_shape(bandwidth: int | None, latency: float, link: int | None) -> WanShape | None:
    """--bandwidth, --latency and --link as a shape; None (no WAN) without --bandwidth."""
    from diloco_anywhere.bench.wan import WanShape

    if bandwidth is None:
        return None
    return WanShape(bandwidth=bandwidth, latency=latency, link=link or 8 * bandwidth)


def _wan_options(
    stack: ExitStack, options: dict[str, Any], shape: WanShape | None, processes: int
) -> list[dict[str, Any]]:
    """Per process (a replica, or a rank), its storage options: with a shape, the stand-in's
    through a shaped link of its own; without, ``options`` as they are."""
    from urllib.parse import urlsplit

    from diloco_anywhere.bench.wan import shaped_links

    if shape is None:
        return [options] * processes
    endpoint = urlsplit(options.get("endpoint_url", ""))
    if not endpoint.port:
        raise typer.BadParameter("--bandwidth shapes a stand-in's link: give --standin s3")
    target = (endpoint.hostname, endpoint.port)
    links = stack.enter_context(shaped_links(target, shape, processes))
    return [{**options, "endpoint_url": f"http://127.0.0.1:{link.port}"} for link in links]


def _sync_table(result: dict[str, Any]) -> Table:
    table = Table(
        title=f"Sync: {result['replicas']} replicas, {result['size_bytes'] / 2**20:.0f} MiB "
        f"each, {result['codec']}, {result['mode']} (median of {result['rounds']} rounds)"
    )
    columns = ("bytes up / replica", "bytes down / replica", "requests", "round s", "raw s")
    for column in (*columns, "memory added"):
        table.add_column(column, justify="right")
    memory = result["host_memory_added_bytes"]
    table.add_row(
        f"{result['bytes_up_per_replica']:,} ({result['up_vs_bound']:.3f}x)",
        f"{result['bytes_down_per_replica']:,} ({result['down_vs_bound']:.3f}x)",
        str(result["requests_per_replica"]),
        f"{result['round_seconds']:.3f}",
        f"{result['raw_copy_seconds']:.3f} ({result['round_vs_raw']:.2f}x)",
        "n/a"
        if memory is None
        else f"{memory / 2**20:,.0f} MiB ({result['host_memory_added_vs_fp32']:.2f}x)",
    )
    wan = ""
    if "wan" in result:
        wan = (
            f"; link bound {result['link_bound_seconds']:.2f} s "
            f"({result['round_vs_link_bound']:.2f}x)"
        )
    table.caption = (
        f"store {result['url']}; (x) = multiple of the {result['mode']} bound for a "
        f"{result['payload_bytes']:,}-byte payload; raw = parallel file copy of the same bytes; "
        f"memory added = peak a sync added to a replica process (x the fp32 payload); codec "
        f"work {result['codec_floor_seconds']:.3f} s on this machine's cores; S3 requests "
        f"for 1,000 rounds: "
        f"${result['s3_request_usd_per_1000_rounds_per_replica']:.2f} per replica{wan}"
    )
    return table


@bench_app.command("sync")
def bench_sync_command(
    replicas: Annotated[int, typer.Option(min=1, max=64, help="Replica processes.")] = 4,
    size: Annotated[
        int, typer.Option(parser=parse_size, help="Bytes of float32 pseudo-gradient per replica.")
    ] = "16MiB",  # type: ignore[assignment]
    mode: Annotated[
        str,
        typer.Option(
            help="gather: every replica reads every contribution; sharded: scatter-reduce "
            "(each replica reduces 1/n of the shards); auto: chosen per round by the bytes "
            "sharding saves."
        ),
    ] = "auto",
    codec: Annotated[str, typer.Option(help="fp32, bf16 or int8.")] = "fp32",
    rounds: Annotated[int, typer.Option(min=1, help="Rounds to take medians over.")] = 3,
    window: Annotated[
        int, typer.Option(min=1, help="Parts in flight per round (memory and concurrency).")
    ] = 8,
    part_size: Annotated[
        int, typer.Option(parser=parse_size, help="Bytes of float32 per part.")
    ] = "4MiB",  # type: ignore[assignment]
    straggler: Annotated[
        float,
        typer.Option(
            min=0,
            help="Seconds the last replica is late every round: the others' requests "
            "while they wait are reported.",
        ),
    ] = 0.0,
    bandwidth: Bandwidth = None,
    latency: Latency = 0.04,
    link: Link = None,
    store_url: Annotated[str | None, STORE_OPTION] = None,
    standin_name: Annotated[str | None, STANDIN_OPTION] = None,
    json_output: JsonOutput = False,
) -> None:
    """Measure N replica processes all-reducing through one store for R rounds.

    Reports per-replica bytes up and down against the mode's bound, requests (and their price
    at S3's), wall time per round, a raw parallel copy of the same bytes, the codec's time
    alone, and the host memory one sync added to a replica process (sampled inside it every
    5 ms). With --bandwidth, each replica reaches the stand-in through its own shaped link
    and the round is compared with what that link allows.
    """
    from diloco_anywhere.bench.sync import MODES, SyncBench, bench_sync

    if mode not in MODES:
        raise typer.BadParameter(f"--mode {mode!r}: this build has {', '.join(MODES)}")
    if codec not in CODEC_NAMES:
        raise typer.BadParameter(f"--codec {codec!r}: choose one of {', '.join(CODEC_NAMES)}")
    shape = _wan_shape(bandwidth, latency, link)
    bench = SyncBench(
        replicas, size, rounds, codec, mode, window, part_size, straggler, shape
    )  # fmt: skip
    with user_errors(), ExitStack() as stack, progress_display() as status:
        url, options = _bench_target(stack, store_url, standin_name, status)
        per_replica = _wan_options(stack, options, shape, replicas)
        result = bench_sync(url, per_replica, bench, status)
    if json_output:
        print_json(result)
        return
    stdout.print(_sync_table(result))


def _number_list(text: str, kind: type, low: float, high: float, what: str) -> list[Any]:
    """``1,2,4`` -> [1, 2, 4]: comma-separated numbers of ``kind``, each ``low`` to ``high``
    (``what`` says what they are, with an example, when they are not)."""
    try:
        numbers = [kind(part) for part in str(text).split(",")]
    except ValueError:
        numbers = []
    if not numbers or not all(low <= n <= high for n in numbers):
        raise typer.BadParameter(f"{text!r}: give {what}")
    return numbers


def _parse_ranks(text: str) -> list[int]:
    """``1,2,4`` -> [1, 2, 4]: rank counts per replica, each 1 to 64."""
    return _number_list(text, int, 1, 64, "rank counts from 1 to 64, e.g. 1,2,4")


def _sharded_table(result: dict[str, Any]) -> Table:
    table = Table(
        title=f"Sharded replicas: {result['replicas']} replicas, "
        f"{result['size_bytes'] / 2**20:.0f} MiB each, {result['codec']} "
        f"(median of {result['rounds']} rounds)"
    )
    baseline = result["baseline_ranks"]
    columns = ("ranks N", "mode", "up / rank (mean, max)", "down / rank (mean, max)",
               "busiest host", f"vs N={baseline}", "bytes / replica",
               f"round s (vs N={baseline})")  # fmt: skip
    wan = "wan" in result
    for column in (*columns, *(("link bound s", "round / bound") if wan else ())):
        table.add_column(column, justify="right")
    for row in result["configs"]:
        cells = [
            str(row["ranks"]), row["mode"],
            f"{row['bytes_up_per_rank_mean']:,.0f}, {row['bytes_up_per_rank_max']:,.0f}",
            f"{row['bytes_down_per_rank_mean']:,.0f}, {row['bytes_down_per_rank_max']:,.0f}",
            f"{row['busiest_host_bytes']:,.0f}",
            f"{row['bytes_per_rank_vs_baseline']:.3f} ({row['expected_vs_baseline']:.3f})",
            f"{row['bytes_per_replica_max']:,.0f}",
            f"{row['round_seconds']:.3f} ({row['round_vs_baseline']:.3f})",
        ]  # fmt: skip
        if wan:
            cells += [f"{row['link_bound_seconds']:.3f}", f"{row['round_vs_link_bound']:.2f}x"]
        table.add_row(*cells)
    worst = max(row["max_mean_error"] for row in result["configs"])
    links = ""
    if wan:
        shape = result["wan"]
        links = (
            f"; every rank through a link of its own: {shape['link']:,.0f} B/s, "
            f"{shape['bandwidth']:,.0f} B/s per connection, {shape['latency']:g} s round trip; "
            f"link bound = busiest rank's bytes / link"
        )
    table.caption = (
        f"store {result['url']}; every rank is a process of its own: busiest host = busiest "
        f"rank (up + down); vs N = bytes per rank over those with N={baseline} "
        f"(expected in brackets); bytes / replica = all its ranks' (one host, if they share "
        f"one); round = first rank's start to last rank's end; worst mean error {worst:.1e}"
        f"{links}"
    )
    return table


@bench_app.command("sharded")
def bench_sharded_command(
    ranks: Annotated[
        str,
        typer.Option(
            help="Rank counts per replica to measure, comma-separated; each rank exchanges "
            "its 1/N slice in its own round namespace, all ranks in parallel.",
        ),
    ] = "1,2,4",
    replicas: Annotated[int, typer.Option(min=1, max=16, help="Replicas.")] = 2,
    size: Annotated[
        int,
        typer.Option(parser=parse_size, help="Bytes of float32 pseudo-gradient per replica."),
    ] = "64MiB",  # type: ignore[assignment]
    mode: Annotated[
        str, typer.Option(help="Every rank's exchange: gather, sharded or auto (as a run).")
    ] = "auto",
    rounds: Annotated[int, typer.Option(min=1, help="Rounds to take medians over.")] = 3,
    bandwidth: Bandwidth = None,
    latency: Latency = 0.04,
    link: Link = None,
    store_url: Annotated[str | None, STORE_OPTION] = None,
    standin_name: Annotated[str | None, STANDIN_OPTION] = None,
    json_output: JsonOutput = False,
) -> None:
    """Measure sharded replicas: R replicas of N rank processes each, rank r exchanging only
    its 1/N of the pseudo-gradient, as with [run] sharding = "fsdp".

    For each N: bytes up and down per rank (mean and max over ranks), the busiest host's
    bytes (here the busiest rank's: every rank is its own process, as on a deployment where
    each rank has its own host), a replica's bytes in all, round wall time from the first
    rank starting to the last finishing, and per-rank traffic relative to the fewest ranks
    measured (expected: about 1/N of N=1's), as is the round time. Each rank checks the mean
    it got. With --bandwidth, every rank reaches the stand-in through its own shaped link (its
    own host and NIC) and the round is compared with what the busiest rank's link allows.
    """
    from diloco_anywhere.bench.sharded import bench_sharded
    from diloco_anywhere.bench.sync import MODES

    if mode not in MODES:
        raise typer.BadParameter(f"--mode {mode!r}: this build has {', '.join(MODES)}")
    shape = _wan_shape(bandwidth, latency, link)
    with user_errors(), ExitStack() as stack, progress_display() as status:
        url, options = _bench_target(stack, store_url, standin_name, status)
        counts = _parse_ranks(ranks)
        # a rank process each: every N uses the first replicas x N
        per_rank = _wan_options(stack, options, shape, replicas * max(counts))
        result = bench_sharded(url, per_rank, replicas, counts, size, rounds, mode, shape, status)
    if json_output:
        print_json(result)
        return
    stdout.print(_sharded_table(result))


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


@bench_app.command("convergence")
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
    codec: Annotated[str, typer.Option(help="fp32, bf16 or int8.")] = "int8",
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
        replicas=tuple(_number_list(replicas, int, 1, 16, "replica counts, e.g. 1,4")),
        sync_every=tuple(_number_list(sync_every, int, 1, 10**6, "H values, e.g. 25,50")),
        outer_lr=tuple(_number_list(outer_lr, float, 1e-6, 10, "rates, e.g. 0.5,0.7")),
        outer_momentum=tuple(_number_list(outer_momentum, float, 0, 0.999, "e.g. 0.9")),
        fragments=tuple(_number_list(fragments, int, 1, 64, "fragment counts, e.g. 1,2")),
        fragment_delay=fragment_delay,
        seeds=tuple(_number_list(seeds, int, 0, 2**31, "seeds, e.g. 0,1")),
        steps=steps, warm_start=warm_start, codec=codec,
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
    for column in ("N", "H", "fragments", "outer lr", "momentum", "seed", "held-out loss",
                   "data parallel", "ratio", "fewer bytes", "seconds"):  # fmt: skip
        table.add_column(column, justify="right")
    for run in result["runs"]:
        fewer = f"{run['fewer_bytes']:.0f}x" if run["fewer_bytes"] else "-"
        table.add_row(
            str(run["replicas"]), str(run["sync_every"]), str(run["fragments"]),
            f"{run['outer_lr']:g}",
            f"{run['outer_momentum']:g}", str(run["seed"]), f"{run['eval_loss']:.4f}",
            f"{run['baseline_eval_loss']:.4f}", f"{run['eval_loss_ratio']:.3f}", fewer,
            f"{run['seconds']:.0f}",
        )  # fmt: skip
    return table


@bench_app.command("overlap")
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


@bench_app.command("throughput")
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


@bench_app.command("chaos")
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


@bench_app.command("unattended")
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
