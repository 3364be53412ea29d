"""``diloco bench data``: preparing a corpus, and streaming it, at growing corpus sizes.

For each size, synthetic text (``.jsonl`` files of 256 MB: documents of random words, each line
numbered so that no two documents are alike) is prepared with the tokenizer into a local
store, timed; the tokenizer alone encodes the first ``TOKENIZER_SAMPLE`` bytes of the same
documents in the same run, so the ratio says what reading, hashing, checksumming and writing
cost over tokenizing. Then a fresh interpreter per size opens the corpus as a replica does
(manifest, plan, fixed units: no bucket to claim in), times its first batch and the batches
after it, and reports its peak resident set: what must not grow with the corpus.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from diloco_anywhere.bench.train import results_of
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.data.defaults import BLOCK_TOKENS, HELDOUT_FRACTION, SHARD_TOKENS
from diloco_anywhere.data.documents import pieces, sources
from diloco_anywhere.data.prepare import prepare, settings_for
from diloco_anywhere.data.source import DataSource, fixed_units
from diloco_anywhere.data.tokenizers import load_tokenizer

FILE_BYTES = 256 << 20
TOKENIZER_SAMPLE = 64 << 20
WORDS = 4096
Progress = Callable[[str], None]


def write_text(folder: Path, size: int, seed: int = 0) -> None:
    """``size`` bytes of ``.jsonl`` documents in files of ``FILE_BYTES``: a block of random
    documents written again and again, each copy's lines numbered apart."""
    rng = np.random.default_rng(seed)
    words = ["".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(2, 9)))
             for _ in range(WORDS)]  # fmt: skip
    lines = []
    for number in range(4096):
        chosen = rng.integers(0, WORDS, rng.integers(50, 400))
        text = " ".join(words[i] for i in chosen)
        lines.append(json.dumps({"text": f"@@@@@@@@ {number} {text}"}) + "\n")
    block = "".join(lines).encode()
    folder.mkdir(parents=True, exist_ok=True)
    written, copy = 0, 0
    while written < size:
        path = folder / f"part-{written // FILE_BYTES:05d}.jsonl"
        with path.open("ab") as file:
            while written < size and file.tell() < FILE_BYTES:
                file.write(block.replace(b"@@@@@@@@", f"{copy:08d}".encode()))
                written += len(block)
                copy += 1


def tokenizer_alone(text: Path, tokenizer_name: str) -> float:
    """Bytes of text per second the tokenizer encodes, on the corpus's first documents."""
    tokenizer, texts, size = load_tokenizer(tokenizer_name), [], 0
    for source in sources(str(text)):
        for piece in pieces(source):
            texts.append(piece.text)
            size += len(piece.text.encode())
            if size >= TOKENIZER_SAMPLE:
                break
        if size >= TOKENIZER_SAMPLE:
            break
    started = time.perf_counter()
    for start in range(0, len(texts), 4096):
        tokenizer.encode(texts[start : start + 4096])
    return size / (time.perf_counter() - started)


def _stream(url: str, seq_len: int, batch: int, batches: int, results: Any) -> None:
    """In a fresh interpreter: open the corpus as a replica does; time its first batch and
    the batches after it; the process's peak resident set."""
    started = time.perf_counter()
    source = DataSource(url, seed=0, batches_per_unit=batches, assign=fixed_units(0, 1, 0, 1))
    stream = source.open(seq_len, batch).batches(0)
    next(stream)
    first = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(batches):
        next(stream)
    seconds = time.perf_counter() - started
    stream.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    results.put({"first_batch_seconds": first, "tokens_per_second": batches * batch * seq_len
                 / seconds, "peak_rss_bytes": peak})  # fmt: skip


def bench_data(
    sizes: list[int], tokenizer_name: str, seq_len: int, batch: int, batches: int,
    progress: Progress,
) -> dict[str, Any]:  # fmt: skip
    """Each size's prepare speed (against the tokenizer alone) and stream figures."""
    tokenizer, rows = load_tokenizer(tokenizer_name), []
    settings = settings_for(tokenizer, "text", HELDOUT_FRACTION, SHARD_TOKENS, BLOCK_TOKENS)
    context = multiprocessing.get_context("spawn")  # its own interpreter: its own peak memory
    with tempfile.TemporaryDirectory(prefix="diloco-bench-data-") as folder:
        for size in sizes:
            text, prepared = Path(folder) / f"text-{size}", Path(folder) / f"prepared-{size}"
            progress(f"{size / 1e9:.1f} GB: writing the text")
            write_text(text, size)
            progress(f"{size / 1e9:.1f} GB: the tokenizer alone")
            alone = tokenizer_alone(text, tokenizer_name)
            progress(f"{size / 1e9:.1f} GB: preparing")
            started = time.perf_counter()
            with Store(str(prepared)) as store:
                manifest = prepare(str(text), store, tokenizer, settings)
            prepare_speed = size / (time.perf_counter() - started)
            progress(f"{size / 1e9:.1f} GB: streaming it in a fresh process")
            results = context.Queue()
            arguments = (str(prepared), seq_len, batch, batches, results)
            (streamed,) = results_of([context.Process(target=_stream, args=arguments)], results)
            rows.append({
                "text_bytes": size, "cores": os.cpu_count(), "tokens": manifest.tokens("train"),
                "shards": len(manifest.shards("train")),
                "prepare_bytes_per_second": prepare_speed,
                "tokenizer_bytes_per_second": alone,
                "prepare_vs_tokenizer": prepare_speed / alone, **streamed,
            })  # fmt: skip
            for path in (text, prepared):  # the disk holds one size at a time
                shutil.rmtree(path)
    smallest = rows[0]
    for row in rows:
        row["peak_rss_over_smallest_bytes"] = row["peak_rss_bytes"] - smallest["peak_rss_bytes"]
        row["first_batch_vs_smallest"] = (
            row["first_batch_seconds"] / smallest["first_batch_seconds"]
        )
    return {"tokenizer": tokenizer_name, "seq_len": seq_len, "batch": batch, "sizes": rows}
