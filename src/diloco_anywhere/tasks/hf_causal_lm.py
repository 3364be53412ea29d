"""A Hugging Face causal language model: any ``transformers`` ``AutoModelForCausalLM``.

``[task.options]``:

- ``model``: a Hub id or local folder to load (``from_pretrained``), or leave it out and give
  ``config``, a table for ``AutoConfig.for_model`` (``model_type = "llama"``, sizes...), to
  build one from scratch with the run's seed. Its ``vocab_size`` and its bos, eos and pad
  token ids default to the tokenizer's (a model type's own defaults, such as Llama's 32,000
  tokens, would size the embedding for another tokenizer);
- ``tokenizer``: a Hub id or local folder (default: ``model``; needed with ``config``);
- ``data``: text to train on: a local path, a store URL (``s3://``, ``gs://``, ...; fsspec), or
  a glob of them, of ``.txt`` (one document per file), ``.jsonl`` (one document per line, its
  ``text_field``) or ``.parquet`` (its ``text_field`` column) files; ``text_field`` ("text");
- ``eval_data``: held-out text in the same forms; else the last ``eval_fraction`` (0.05) of the
  documents are held out;
- ``seq_len`` (512), ``batch_size`` (8, sequences per micro-batch), ``grad_accumulation`` (1,
  micro-batches per inner step), ``eval_batches`` (8);
- ``warmup_steps`` (100) and ``min_lr_ratio`` (0.1): the inner learning rate warms up linearly,
  then follows a cosine to ``min_lr_ratio`` x ``diloco.inner_lr`` at the run's last inner step
  (the schedule is a function of the run's inner step, so it is where it should be after a heal
  or restart); ``max_grad_norm`` (1.0; 0: no clipping).

Documents are split between replicas (document ``i`` to replica ``i mod replicas``), tokenized
with the model's tokenizer and joined with its end-of-sequence token; batch ``b`` draws windows
from a generator seeded by (seed, replica, rank, b), so any batch can be the first. On a GPU the
forward pass runs under bfloat16 autocast. The token stream of a replica's shard is held in
memory (4 bytes a token): for corpora larger than that, pre-split the data per replica.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import torch
from torch import nn

from diloco_anywhere.data.defaults import HELDOUT_FRACTION
from diloco_anywhere.data.tokenizers import HfTokenizer
from diloco_anywhere.task import (
    Task,
    TaskContext,
    batch_generator,
    held_out_loss,
    inputs_and_targets,
    windows,
)

OPTIONS = (
    "model", "config", "tokenizer", "data", "eval_data", "text_field", "eval_fraction",
    "seq_len", "batch_size", "grad_accumulation", "eval_batches", "warmup_steps",
    "min_lr_ratio", "max_grad_norm",
)  # fmt: skip
Batch = list[tuple[torch.Tensor, torch.Tensor]]  # micro-batches of (inputs, targets)


def read_documents(source: str, text_field: str) -> list[str]:
    """Every document of ``source`` (a path, URL or glob), files in sorted order."""
    files = sorted(fsspec.open_files(source, "rt", encoding="utf-8"), key=lambda f: f.path)
    if not files:
        raise ValueError(f"task data {source!r}: no file there (a path, URL or glob of files)")
    documents: list[str] = []
    for file in files:
        suffix = Path(file.path).suffix
        if suffix == ".parquet":
            documents += _parquet_column(file.fs, file.path, text_field)
            continue
        with file as text:
            if suffix == ".jsonl":
                documents += [_field(line, text_field, file.path) for line in text if line.strip()]
            else:
                documents.append(text.read())
    return documents


def _field(line: str, field: str, path: str) -> str:
    record = json.loads(line)
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
        raise ValueError(f"task data {path}: a line without a string {field!r} field")
    return record[field]


def _parquet_column(fs: Any, path: str, field: str) -> list[str]:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise ValueError(f"task data {path}: reading parquet needs pyarrow installed") from None
    with fs.open(path, "rb") as file:
        table = parquet.read_table(file, columns=[field])
    return [str(value) for value in table.column(field).to_pylist()]


def token_stream(documents: list[str], tokenizer: Any) -> torch.Tensor:
    """The documents' tokens, each followed by the end-of-sequence token."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token: set one (documents are joined with it)")
    ids = tokenizer(documents, add_special_tokens=False)["input_ids"] if documents else []
    return torch.tensor([token for doc in ids for token in (*doc, eos)], dtype=torch.int32)


def inner_lr_schedule(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """The inner learning rate's multiplier at inner step ``step``: linear warmup, then a
    cosine from 1 to ``min_ratio`` at ``total``."""

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier


def _check_model_options(options: dict[str, Any]) -> None:
    if "model" in options:
        return
    if not isinstance(options.get("config"), dict) or "model_type" not in options["config"]:
        raise ValueError(
            "task options need `model` (a Hub id or folder) or `config` (a table with "
            "model_type and sizes, for AutoConfig.for_model)"
        )


def _tokenizer(options: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    source = options.get("tokenizer", options.get("model"))
    if source is None:
        raise ValueError(
            "task options need `tokenizer` (a Hub id or folder) for a model built from "
            "`config`, or `model`, whose tokenizer is used"
        )
    return AutoTokenizer.from_pretrained(source)


def _model(options: dict[str, Any], tokenizer: Any, seed: int, device: torch.device) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    if "model" in options:
        return AutoModelForCausalLM.from_pretrained(options["model"]).to(device)
    config = {**_tokenizer_defaults(tokenizer), **options["config"]}
    torch.manual_seed(seed)  # the same initial weights on every replica
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).to(device)


def _tokenizer_defaults(tokenizer: Any) -> dict[str, Any]:
    """What a model built from ``config`` takes from its tokenizer unless ``config`` says."""
    ids = {
        f"{name}_token_id": getattr(tokenizer, f"{name}_token_id", None)
        for name in ("bos", "eos", "pad")
    }
    return {"vocab_size": len(tokenizer), **{k: v for k, v in ids.items() if v is not None}}


def _check_fits(model: nn.Module, tokenizer: Any, seq_len: int) -> None:
    """The model can take every token id and ``seq_len`` positions: otherwise a replica would
    fail at its first batch with an index error (or, for position ids, train on garbage)."""
    rows = model.get_input_embeddings().num_embeddings
    if rows < len(tokenizer):
        raise ValueError(
            f"task options: the model's embedding has {rows} rows but the tokenizer has "
            f"{len(tokenizer)} tokens: set config.vocab_size to at least {len(tokenizer)}, "
            f"or leave it out (it defaults to the tokenizer's)"
        )
    for name in ("max_position_embeddings", "n_positions"):
        positions = getattr(model.config, name, None)
        if isinstance(positions, int) and seq_len > positions:
            raise ValueError(
                f"task options: seq_len = {seq_len} is more than the model's {name} = "
                f"{positions}: lower seq_len, or raise {name} in config"
            )


def _random_windows(
    tokens: torch.Tensor, generator: torch.Generator, count: int, seq_len: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.randint(len(tokens) - seq_len, (count,), generator=generator)
    return windows(tokens, offsets, seq_len, device)


Batches = Callable[[int], Iterator[Batch]]


def _streamed(
    context: TaskContext, tokenizer: Any, seq_len: int, batch_size: int, accumulation: int
) -> tuple[Batches, list[tuple[torch.Tensor, torch.Tensor]]]:
    """run.toml's ``[task] data``, streamed: a corpus prepared with the task's tokenizer, or raw
    text the run prepares with it (``text_field``; ``eval_fraction`` of the documents held
    out); each inner step's sequences cut into its micro-batches."""
    options = context.options
    if given := sorted({"data", "eval_data"} & options.keys()):
        raise ValueError(
            f"task options {given} and run.toml [task] data both say what to train on: give "
            f"one (a corpus holds its own held-out split: eval_fraction of its documents)"
        )
    name = options.get("tokenizer", options.get("model"))
    stream = context.stream(
        seq_len, batch_size * accumulation, HfTokenizer(name, tokenizer),
        text_field=options.get("text_field", "text"),
        heldout_fraction=float(options.get("eval_fraction", HELDOUT_FRACTION)),
    )  # fmt: skip
    device = context.device

    def batches(start: int) -> Iterator[Batch]:
        for rows in stream.batches(start):
            yield [inputs_and_targets(part, device) for part in rows.split(batch_size)]

    evaluation = stream.evaluation(int(context.options.get("eval_batches", 8)), batch_size)
    return batches, [inputs_and_targets(rows, device) for rows in evaluation]


def _in_memory(
    context: TaskContext, tokenizer: Any, seq_len: int, batch_size: int, accumulation: int
) -> tuple[Batches, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The ``data`` option's text, tokenized and held in memory: this replica's documents,
    windows drawn at random."""
    options, device = context.options, context.device
    if "data" not in options:
        raise ValueError(
            "task options need `data` (the text to train on: a path, URL or glob), or "
            "run.toml [task] data a prepared corpus"
        )
    field = options.get("text_field", "text")
    documents = read_documents(options["data"], field)
    if "eval_data" in options:
        held_out_documents = read_documents(options["eval_data"], field)
    else:
        split = len(documents) - max(1, int(len(documents) * options.get("eval_fraction", 0.05)))
        documents, held_out_documents = documents[:split], documents[split:]
    shard = token_stream(documents[context.replica_index :: context.replicas], tokenizer)
    held_out = token_stream(held_out_documents, tokenizer)
    for name, tokens in (("this replica's shard", shard), ("the held-out text", held_out)):
        if len(tokens) <= seq_len:
            raise ValueError(
                f"task data: {name} has {len(tokens)} tokens, not more than seq_len = "
                f"{seq_len}: give more text or a smaller seq_len"
            )

    def batches(start: int) -> Iterator[Batch]:
        for index in itertools.count(start):
            generator = batch_generator(context, index)
            yield [_random_windows(shard, generator, batch_size, seq_len, device)
                   for _ in range(accumulation)]  # fmt: skip

    generator = torch.Generator().manual_seed(context.seed)  # the same windows everywhere
    eval_set = [_random_windows(held_out, generator, batch_size, seq_len, device)
                for _ in range(int(options.get("eval_batches", 8)))]  # fmt: skip
    return batches, eval_set


def build(context: TaskContext) -> Task:
    options = context.options
    if unknown := sorted(set(options) - set(OPTIONS)):
        raise ValueError(f"task options {unknown} unknown; hf_causal_lm takes {list(OPTIONS)}")
    seq_len, batch_size = int(options.get("seq_len", 512)), int(options.get("batch_size", 8))
    accumulation = int(options.get("grad_accumulation", 1))
    _check_model_options(options)
    tokenizer = _tokenizer(options)
    model = _model(options, tokenizer, context.seed, context.device)
    _check_fits(model, tokenizer, seq_len)
    if context.data is not None:
        batches, eval_set = _streamed(context, tokenizer, seq_len, batch_size, accumulation)
    else:
        batches, eval_set = _in_memory(context, tokenizer, seq_len, batch_size, accumulation)
    device = context.device

    def loss(model: nn.Module, micro_batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = micro_batch
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=inputs).logits
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def save(model: nn.Module, folder: Path) -> None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    max_norm = float(options.get("max_grad_norm", 1.0))
    return Task(
        model, batches, loss, batch_size * seq_len * accumulation,
        held_out_loss(loss, eval_set), save,
        micro_batches=True, max_grad_norm=max_norm or None,
        lr_schedule=inner_lr_schedule(
            int(options.get("warmup_steps", 100)), context.total_steps,
            float(options.get("min_lr_ratio", 0.1)),
        ),
    )  # fmt: skip
