"""A Hugging Face causal language model: any ``transformers`` ``AutoModelForCausalLM``.

``[task.options]``:

- ``model``: a Hub id or local folder to load (``from_pretrained``), or leave it out and give
  ``config``, a table for ``AutoConfig.for_model`` (``model_type = "llama"``, sizes...), to
  build one from scratch with the run's seed. Its ``vocab_size`` and its bos, eos and pad
  token ids default to the tokenizer's (a model type's own defaults, such as Llama's 32,000
  tokens, would size the embedding for another tokenizer);
- ``tokenizer``: a Hub id or local folder (default: ``model``; needed with ``config``);
- ``data``: raw text to train on when run.toml's ``[task] data`` names none: a local path, a
  store URL (``s3://``, ``gs://``, ...; fsspec), or a glob of them, of ``.txt`` (one document
  per file), ``.jsonl`` (one document per line, its ``text_field``) or ``.parquet`` (its
  ``text_field`` column) files, optionally compressed; ``text_field`` ("text");
  ``eval_fraction`` (0.05) of its documents, chosen by a hash of their text, are held out;
- ``seq_len`` (512), ``batch_size`` (8, sequences per micro-batch), ``grad_accumulation`` (1,
  micro-batches per inner step), ``eval_batches`` (8);
- ``warmup_steps`` (100) and ``min_lr_ratio`` (0.1): the inner learning rate warms up linearly,
  then follows a cosine to ``min_lr_ratio`` x ``diloco.inner_lr`` at the run's last inner step
  (the schedule is a function of the run's inner step, so it is where it should be after a heal
  or restart); ``max_grad_norm`` (1.0; 0: no clipping).

The data is streamed (``data/``): a corpus prepared once with the model's tokenizer (run.toml's
``[task] data``), or raw text the run's first replica prepares into its store; every replica
reads only what it trains, and every sequence is trained once an epoch whatever the replicas
do. On a GPU the forward pass runs under bfloat16 autocast.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diloco_anywhere.data.stream import Stream
from diloco_anywhere.data.tokenizers import HfTokenizer
from diloco_anywhere.task import Task, TaskContext, held_out_loss, inputs_and_targets

EVAL_FRACTION = 0.05
OPTIONS = (
    "model", "config", "tokenizer", "data", "eval_data", "text_field", "eval_fraction",
    "seq_len", "batch_size", "grad_accumulation", "eval_batches", "warmup_steps",
    "min_lr_ratio", "max_grad_norm",
)  # fmt: skip
Batch = list[tuple[torch.Tensor, torch.Tensor]]  # micro-batches of (inputs, targets)


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


def _stream(
    context: TaskContext, tokenizer: Any, seq_len: int, batch_size: int, accumulation: int
) -> Stream:
    """The run's data (run.toml's ``[task] data``), else the ``data`` option's raw text, each
    prepared with the task's tokenizer (``text_field``; ``eval_fraction`` of the documents held
    out): each inner step's sequences are its micro-batches."""
    options = context.options
    if "eval_data" in options:
        raise ValueError(
            "task option eval_data is gone: a corpus holds its own held-out split, "
            "eval_fraction of its documents chosen by a hash of their text"
        )
    if "data" in options and context.data is not None and context.data.corpus:
        raise ValueError(
            "task option data and run.toml [task] data both say what to train on: give one"
        )
    if "data" not in options and (context.data is None or not context.data.corpus):
        raise ValueError(
            "no data: set run.toml [task] data (a corpus `diloco data prepare` wrote, or raw "
            "text), or the task option data (raw text: a path, URL or glob)"
        )
    name = options.get("tokenizer", options.get("model"))
    return context.stream(
        seq_len, batch_size * accumulation, HfTokenizer(name, tokenizer),
        default=options.get("data", ""), text_field=options.get("text_field", "text"),
        heldout_fraction=float(options.get("eval_fraction", EVAL_FRACTION)),
    )  # fmt: skip


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
    stream = cache(lambda: _stream(context, tokenizer, seq_len, batch_size, accumulation))
    device = context.device

    def batches(start: int) -> Iterator[Batch]:
        for rows in stream().batches(start):
            yield [inputs_and_targets(part, device) for part in rows.split(batch_size)]

    def eval_set() -> list[tuple[torch.Tensor, torch.Tensor]]:
        evaluation = stream().evaluation(int(options.get("eval_batches", 8)), batch_size)
        return [inputs_and_targets(rows, device) for rows in evaluation]

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
