"""``diloco bench data``: preparing a corpus and streaming it, at growing corpus sizes."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from diloco_anywhere.cli.bench.options import JsonOutput
from diloco_anywhere.cli.common import parse_size, print_json, progress_display, stdout, user_errors


def _sizes(text: str) -> list[int]:
    return [parse_size(part) for part in str(text).split(",")]


def _data_table(result: dict[str, Any]) -> Table:
    table = Table(title=f"Data: tokenizer {result['tokenizer']}, batches of {result['batch']} x "
                  f"{result['seq_len']} tokens")  # fmt: skip
    table.caption = (
        "prepare and tokenizer: MB of text per second on all cores (per core in brackets); "
        "first batch: from opening the corpus; peak RSS: the streaming process's own"
    )
    columns = ("text", "shards", "prepare MB/s", "tokenizer MB/s", "prepare/tokenizer",
               "first batch s", "tokens/s", "peak RSS", "over smallest")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for row in result["sizes"]:
        cores = row["cores"]
        table.add_row(
            f"{row['text_bytes'] / 1e9:.1f} GB", str(row["shards"]),
            f"{row['prepare_bytes_per_second'] / 1e6:.1f} "
            f"({row['prepare_bytes_per_second'] / 1e6 / cores:.1f})",
            f"{row['tokenizer_bytes_per_second'] / 1e6:.1f}", f"{row['prepare_vs_tokenizer']:.2f}x",
            f"{row['first_batch_seconds']:.2f}", f"{row['tokens_per_second']:,.0f}",
            f"{row['peak_rss_bytes'] / 2**20:,.0f} MiB",
            f"{row['peak_rss_over_smallest_bytes'] / 2**20:+,.0f} MiB",
        )  # fmt: skip
    return table


def bench_data_command(
    sizes: Annotated[
        str,
        typer.Option(
            help="Corpus sizes of text, comma-separated (e.g. 200MB,1GB,4GB): each is written, "
            "prepared and streamed in turn, then deleted.",
        ),
    ] = "200MB,1GB,4GB",
    tokenizer: Annotated[
        str, typer.Option(help="bytes, or a Hugging Face tokenizer (a Hub id or a folder).")
    ] = "bytes",
    seq_len: Annotated[int, typer.Option(min=1, help="Tokens per sequence.")] = 1024,
    batch: Annotated[int, typer.Option(min=1, help="Sequences per batch.")] = 16,
    batches: Annotated[int, typer.Option(min=1, help="Batches streamed after the first.")] = 200,
    json_output: JsonOutput = False,
) -> None:
    """Measure preparing a corpus (against the tokenizer alone on the same text) and streaming
    it as a replica does: time to the first batch, tokens/s, and the streaming process's peak
    memory, which should not grow with the corpus.

    Needs the disk for one size's text and shards at a time (twice its size with bytes).
    """
    from diloco_anywhere.bench.data import bench_data

    with user_errors(), progress_display() as status:
        result = bench_data(_sizes(sizes), tokenizer, seq_len, batch, batches, status)
    if json_output:
        print_json(result)
        return
    stdout.print(_data_table(result))
