"""``diloco bench sync`` and ``diloco bench sharded``: replicas (or each replica's ranks)
exchanging pseudo-gradients through one store."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Annotated, Any

import typer
from rich.table import Table

from diloco_anywhere.cli.bench.options import (
    STANDIN_OPTION,
    STORE_OPTION,
    Bandwidth,
    JsonOutput,
    Latency,
    Link,
    bench_target,
    number_list,
    wan_options,
    wan_shape,
)
from diloco_anywhere.cli.common import parse_size, print_json, progress_display, stdout, user_errors
from diloco_anywhere.config import ConfigError, parse_codec


def sync_table(result: dict[str, Any]) -> Table:
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
    split = ", ".join(
        f"{phase} {seconds:.3f}" for phase, seconds in result["phase_seconds"].items()
    )
    table.caption = (
        f"where a replica's round goes, in thread-seconds (they overlap): {split}; "
        f"store {result['url']}; (x) = multiple of the {result['mode']} bound for a "
        f"{result['payload_bytes']:,}-byte payload; raw = parallel file copy of the same bytes; "
        f"memory added = peak a sync added to a replica process (x the fp32 payload); codec "
        f"work {result['codec_floor_seconds']:.3f} s on this machine's cores; S3 requests "
        f"for 1,000 rounds: "
        f"${result['s3_request_usd_per_1000_rounds_per_replica']:.2f} per replica{wan}"
    )
    return table


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
    codec: Annotated[
        str,
        typer.Option(
            metavar="CODEC",
            help="fp32, bf16, int8 or sparse; sparse with its [diloco.sparse] settings after "
            "colons (sparse:density=0.08). No error feedback here: the bytes and the time.",
        ),
    ] = "fp32",
    rounds: Annotated[int, typer.Option(min=1, help="Rounds to take medians over.")] = 3,
    window: Annotated[
        int, typer.Option(min=1, help="Parts in flight per round (memory and concurrency).")
    ] = 8,
    window_max: Annotated[
        int,
        typer.Option(
            min=1,
            help="The widest the window may grow to between rounds while a wider one moves "
            "parts faster ([sync] window_max); --window's value keeps it fixed.",
        ),
    ] = 32,
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
    device: Annotated[
        str,
        typer.Option(
            help="Where each replica's pseudo-gradient lives: cpu, or cuda (encoded on the "
            "GPU, one copy of each part to pinned host memory)."
        ),
    ] = "cpu",
    json_output: JsonOutput = False,
) -> None:
    """Measure N replica processes all-reducing through one store for R rounds.

    Reports per-replica bytes up and down against the mode's bound, requests (and their price
    at S3's), wall time per round, a raw parallel copy of the same bytes, the codec's time
    alone, where a round's time goes (thread-seconds of transfer, checksum, decode, reduce,
    encode and waiting), and the host memory one sync added to a replica process (sampled
    inside it every 5 ms). With --bandwidth, each replica reaches the stand-in through its own
    shaped link and the round is compared with what that link allows.
    """
    from diloco_anywhere.bench.sync import MODES, SyncBench, bench_sync

    if mode not in MODES:
        raise typer.BadParameter(f"--mode {mode!r}: this build has {', '.join(MODES)}")
    try:
        parse_codec(codec)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="--codec") from None
    if device not in ("cpu", "cuda"):
        raise typer.BadParameter(f"{device!r}: cpu or cuda", param_hint="--device")
    shape = wan_shape(bandwidth, latency, link)
    bench = SyncBench(
        replicas, size, rounds, codec, mode, window, part_size, straggler, shape, device,
        window_max,
    )  # fmt: skip
    with user_errors(), ExitStack() as stack, progress_display() as status:
        url, options = bench_target(stack, store_url, standin_name, status)
        per_replica = wan_options(stack, options, shape, replicas)
        result = bench_sync(url, per_replica, bench, status)
    if json_output:
        print_json(result)
        return
    stdout.print(sync_table(result))


def _parse_ranks(text: str) -> list[int]:
    """``1,2,4`` -> [1, 2, 4]: rank counts per replica, each 1 to 64."""
    return number_list(text, int, 1, 64, "rank counts from 1 to 64, e.g. 1,2,4")


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
    shape = wan_shape(bandwidth, latency, link)
    with user_errors(), ExitStack() as stack, progress_display() as status:
        url, options = bench_target(stack, store_url, standin_name, status)
        counts = _parse_ranks(ranks)
        # a rank process each: every N uses the first replicas x N
        per_rank = wan_options(stack, options, shape, replicas * max(counts))
        result = bench_sharded(url, per_rank, replicas, counts, size, rounds, mode, shape, status)
    if json_output:
        print_json(result)
        return
    stdout.print(_sharded_table(result))
