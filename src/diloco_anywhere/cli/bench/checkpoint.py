"""``diloco bench checkpoint``: the host memory and the time of a model's checkpoint writes,
heals, export and resume against the raw store transfer of its bytes (docs/benchmarks.md,
"Checkpoints at model scale")."""

from __future__ import annotations

import tempfile
from typing import Annotated, Any

import typer
from rich.table import Table

from diloco_anywhere.cli.bench.options import JsonOutput
from diloco_anywhere.cli.common import parse_size, print_json, progress_display, stdout, user_errors

LABELS = {
    "sync": "a round (for comparison)",
    "write": "write a checkpoint",
    "write_during_sync": "write during a round (beyond it)",
    "heal": "heal from a checkpoint",
    "heal_replay": "heal, replaying rounds",
    "export": "diloco export",
    "resume": "resume (heal and own state)",
}


def checkpoint_table(result: dict[str, Any]) -> Table:
    size = result["size"]
    table = Table(title=f"Checkpoints of a {size / 2**30:g} GiB model (P) in {result['store']}")
    for column in ("operation", "memory added", "seconds", "x raw transfer"):
        table.add_column(column, justify="right" if column != "operation" else "left")
    for name, row in result["operations"].items():
        added = row["memory_added_vs_p"]
        ratio = row["seconds_vs_raw"]
        table.add_row(
            LABELS[name], "-" if added is None else f"{added:.2f}x P",
            f"{row['seconds']:.1f}", "-" if ratio is None else f"{ratio:.2f}x",
        )  # fmt: skip
    raw = result["raw"]
    table.caption = (
        f"memory added: the peak resident set an operation held only while it ran, over P (a "
        f"write during a round: memory and time beyond the round's own); x raw transfer: its "
        f"time over the raw put and get of the bytes it moves (a checkpoint 2P: weights and "
        f"outer momentum; own state 2P: AdamW's moments; a replayed round P/4, int8; an "
        f"export P in and out), at "
        f"the speed of one put ({raw['write_seconds']:.1f} s) and one get "
        f"({raw['read_seconds']:.1f} s) of P bytes; heal replays {result['replay']} rounds"
    )
    return table


def bench_checkpoint_command(
    size: Annotated[
        int,
        typer.Option(
            parser=parse_size,
            help="The model's fp32 weights, P (1GiB: 4 x "
            "Linear(8192, 8192)). The replica holds about 6 P while it trains.",
        ),
    ] = "1GiB",  # type: ignore[assignment]
    store_url: Annotated[
        str | None,
        typer.Option(
            "--store",
            help="Store URL (credentials from the environment). Default: a temporary local folder.",
        ),
    ] = None,
    replay: Annotated[int, typer.Option(min=1, help="Rounds a heal replays.")] = 3,
    json_output: JsonOutput = False,
) -> None:
    """Measure what checkpoints of a model of --size hold in host memory and take.

    Each operation runs in a fresh process of its own, its resident set sampled every 5 ms:
    a round of training, writing a checkpoint, writing one while the next round runs, healing
    from one (and replaying rounds after it), diloco export, and resuming a replica (heal and
    its own state: AdamW's moments). Reports the memory each held only while it ran, as x P,
    and its time against one put or get of P bytes through the store. Takes minutes.
    """
    from diloco_anywhere.bench.checkpoint import CheckpointBench, bench_checkpoint

    folder = tempfile.TemporaryDirectory(prefix="diloco-bench-checkpoint-")
    with user_errors(), progress_display() as status, folder as default:
        result = bench_checkpoint(CheckpointBench(size, store_url or default, replay), status)
    if json_output:
        print_json(result)
        return
    stdout.print(checkpoint_table(result))
