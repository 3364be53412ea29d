"""``diloco bench store``: store put/get against a raw file copy, and the codecs; ``diloco bench
codecs``: each codec per GiB of pseudo-gradient."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Annotated, Any

import typer
from rich.table import Table

from diloco_anywhere.bucket.store import Store
from diloco_anywhere.cli.bench.options import (
    STANDIN_OPTION,
    STORE_OPTION,
    JsonOutput,
    bench_target,
)
from diloco_anywhere.cli.common import parse_size, print_json, progress_display, stdout, user_errors


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
        url, options = bench_target(stack, store_url, standin_name, status)
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


def _per_gib_table(result: dict[str, Any]) -> Table:
    size = result["size_bytes"] / 2**30
    table = Table(title=f"Codecs per GiB of float32 ({size:.2f} GiB, median of "
                  f"{result['repeats']}; wire path: header + CRC32C)")  # fmt: skip
    table.caption = (
        "s/GiB: seconds per GiB of float32; memory: peak resident bytes added per GiB (decode "
        "includes its float32 result); feedback: error feedback's encode and decode of what "
        "was sent; vs int8: encode + decode time over int8's in this run"
    )
    columns = ("codec", "size/fp32", "err Gauss", "err t(3)", "encode s/GiB", "decode s/GiB",
               "vs int8", "feedback s/GiB", "encode memory", "decode memory")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "codec" else "right")
    for row in result["codecs"]:
        memory = [row[f"{op}_memory_added_per_gib"] for op in ("encode", "decode")]
        table.add_row(
            row["label"], f"1/{1 / row['ratio']:.0f}", f"{row['rel_l2_gaussian']:.2e}",
            f"{row['rel_l2_student_t']:.2e}", f"{row['encode_seconds_per_gib']:.2f}",
            f"{row['decode_seconds_per_gib']:.2f}", f"{row['encode_plus_decode_vs_int8']:.2f}x",
            f"{row['feedback_seconds_per_gib']:.2f}",
            *("-" if m is None else f"{m / 2**30:.2f} GiB" for m in memory),
        )  # fmt: skip
    return table


def bench_codecs_command(
    codec: Annotated[
        list[str],
        typer.Option(
            metavar="CODEC",
            help="A codec to measure, repeatable: fp32, bf16, int8 or sparse, sparse with its "
            "[diloco.sparse] settings after colons (sparse:density=0.03:bits=4). int8 is "
            "always measured: the others are compared with it.",
        ),
    ] = ["sparse"],  # noqa: B006 (typer reads the default; it is never mutated)
    size: Annotated[
        int, typer.Option(parser=parse_size, help="Bytes of float32 pseudo-gradient (e.g. 1GiB).")
    ] = "1GiB",  # type: ignore[assignment]
    repeats: Annotated[int, typer.Option(min=1, help="Runs to take the median of.")] = 3,
    json_output: JsonOutput = False,
) -> None:
    """Measure each codec per GiB of pseudo-gradient: encode, decode and error-feedback
    seconds, the memory each adds, bytes over fp32 and error, against int8 in the same run.

    Each codec runs in a fresh process of its own; at 1GiB a run takes a minute or two per
    codec and about 3 GiB of memory.
    """
    from diloco_anywhere.bench.codecs import bench_codecs_per_gib

    with user_errors(), progress_display() as status:
        result = bench_codecs_per_gib(codec, size, repeats, status)
    if json_output:
        print_json(result)
        return
    stdout.print(_per_gib_table(result))
