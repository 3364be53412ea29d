"""``diloco data``: a corpus tokenized once into token shards in a store (``data/``)."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer
from rich.progress import (
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from diloco_anywhere.cli.bench.options import JsonOutput
from diloco_anywhere.cli.common import print_json, stderr, stdout, user_errors
from diloco_anywhere.data.defaults import BLOCK_TOKENS, HELDOUT_FRACTION, SHARD_TOKENS

data_app = typer.Typer(
    rich_markup_mode=None,
    help="Training data: a corpus tokenized once into checked token shards in a store.",
    no_args_is_help=True,
)


@data_app.command("prepare")
def prepare_command(
    corpus: Annotated[
        str,
        typer.Argument(
            help="A file, folder or glob of .txt, .jsonl or .parquet files (.gz, "
            ".bz2, .xz or .zst after the first two): a path or any fsspec URL."
        ),
    ],
    destination: Annotated[
        str,
        typer.Argument(
            help="The store folder for the shards: a path, file://, s3://, gs://, "
            "az:// or hf://buckets/... (credentials from the environment)."
        ),
    ],
    tokenizer: Annotated[
        str,
        typer.Option(
            help="The run's tokenizer: a Hugging Face Hub id or folder, or bytes "
            "(the built-in GPT's: a token per byte)."
        ),
    ],
    text_field: Annotated[
        str, typer.Option(help="The text of a .jsonl line or a .parquet row.")
    ] = "text",
    heldout_fraction: Annotated[
        float,
        typer.Option(
            min=0,
            max=1,
            help="Share of documents held out for evaluation, chosen by "
            "a hash of each document's text: adding files moves none.",
        ),
    ] = HELDOUT_FRACTION,
    shard_tokens: Annotated[
        int, typer.Option(min=1, help="Tokens per shard (a shard is one object).")
    ] = SHARD_TOKENS,
    block_tokens: Annotated[
        int,
        typer.Option(
            min=1,
            help="Tokens per checksummed block: the most a replica reads at "
            "once; far more than a sequence.",
        ),
    ] = BLOCK_TOKENS,
    json_output: JsonOutput = False,
) -> None:
    """Tokenize a corpus once into token shards and a manifest in a store folder.

    Files are read in path order, each document whole to the training or the held-out split
    (by a hash of its text), followed by the tokenizer's end-of-sequence token, on all cores.
    Run it again after an interruption, with the same settings: files already done are not
    read again, shards already written are not written again. A finished folder never
    changes: prepare a changed corpus into a new one.
    """
    from diloco_anywhere.bucket.store import Store
    from diloco_anywhere.data.prepare import prepare, settings_for
    from diloco_anywhere.data.tokenizers import load_tokenizer

    with user_errors():
        loaded = load_tokenizer(tokenizer)
        settings = settings_for(loaded, text_field, heldout_fraction, shard_tokens, block_tokens)
        columns = (SpinnerColumn(), TextColumn("{task.description}"), DownloadColumn(),
                   TransferSpeedColumn(), TimeElapsedColumn())  # fmt: skip
        started, tokenized = time.perf_counter(), [0]

        def advance(nbytes: int) -> None:
            tokenized[0] += nbytes
            bar.advance(task, nbytes)

        with Store(destination) as store, Progress(*columns, console=stderr, transient=True) as bar:
            task = bar.add_task("tokenizing", total=None)
            manifest = prepare(corpus, store, loaded, settings, advance)
            where = store.url
    summary = _summary(manifest, time.perf_counter() - started, tokenized[0], where)
    if json_output:
        print_json(summary)
        return
    stdout.print(_table(summary))


def _summary(manifest: Any, seconds: float, tokenized: int, where: str) -> dict[str, Any]:
    """The corpus by split, and what this prepare tokenized (none: it was done already)."""
    text = sum(source.text_bytes for source in manifest.sources)
    splits = {
        split: {
            "documents": manifest.documents(split),
            "tokens": manifest.tokens(split),
            "shards": len(manifest.shards(split)),
            "bytes": sum(shard.size for shard in manifest.shards(split)),
        }
        for split in ("train", "heldout")
    }  # fmt: skip
    return {
        "manifest": f"{where}/manifest", "files": len(manifest.sources), "text_bytes": text,
        "seconds": seconds, "tokenized_bytes": tokenized,
        "text_mb_per_second": tokenized / 1e6 / seconds if tokenized else None,
        "tokenizer": manifest.settings.tokenizer.name, "dtype": manifest.settings.dtype,
        **splits,
    }  # fmt: skip


def _table(summary: dict[str, Any]) -> Table:
    table = Table(
        title=f"{summary['files']} files, {summary['text_bytes'] / 1e6:,.1f} MB of text, "
        f"{summary['tokenizer']} ({summary['dtype']})"
    )
    for column in ("split", "documents", "tokens", "shards", "bytes"):
        table.add_column(column, justify="left" if column == "split" else "right")
    for split in ("train", "heldout"):
        row = summary[split]
        table.add_row(split, f"{row['documents']:,}", f"{row['tokens']:,}", str(row["shards"]),
                      f"{row['bytes']:,}")  # fmt: skip
    speed = summary["text_mb_per_second"]
    done = f"{speed:.2f} MB of text per second" if speed else "prepared already: nothing to do"
    notes = [f"{summary['manifest']}; {summary['seconds']:.1f} s, {done}"]
    if summary["heldout"]["documents"] == 0:
        notes.append("no document is held out: prepare again into a new folder with a larger "
                     "--heldout-fraction to evaluate on held-out text")  # fmt: skip
    table.caption = "\n".join(notes)
    return table
