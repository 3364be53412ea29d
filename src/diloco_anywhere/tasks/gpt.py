"""The built-in task: a byte-level GPT trained on text that every machine already has.

The default corpus is the running interpreter's own standard library (its ``.py`` sources,
``data/stdlib.py``), so a demo needs no download and no credentials. Like any raw text, the
run's first replica prepares it into the run's store (``data/prepare_once.py``) and every
replica streams that copy (``data/stream.py``): every sequence once an epoch, in one order
whatever the replicas do, and the same held-out text for all, whatever their Python version.

The model is GPT-2's decoder (Radford et al. 2019 (GPT-2)): pre-LayerNorm blocks, a final
LayerNorm, and an output head tied to the token embedding. Bytes are the tokens (vocabulary 256),
so no tokenizer has to be shipped or agreed on.

``[task.options]``: ``preset`` (tiny | small | base), ``seq_len``, ``batch_size``, ``corpus``
("stdlib", or a path, URL or glob of .txt / .jsonl / .parquet files: raw text, when run.toml's
``[task] data`` names none), ``corpus_bytes`` (its first files up to this size) and
``eval_batches``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from diloco_anywhere.data.stdlib import STDLIB
from diloco_anywhere.data.stream import Stream
from diloco_anywhere.data.tokenizers import ByteTokenizer
from diloco_anywhere.task import Task, TaskContext, held_out_loss, inputs_and_targets

VOCAB = 256  # one token per byte value
EVAL_FRACTION = 0.05
CORPUS_BYTES = 8_000_000  # of the default corpus: its first files up to this size
OPTIONS = ("preset", "seq_len", "batch_size", "corpus", "corpus_bytes", "eval_batches")


@dataclass(frozen=True)
class Preset:
    layers: int
    d_model: int
    heads: int
    seq_len: int


PRESETS = {
    "tiny": Preset(layers=2, d_model=64, heads=4, seq_len=64),  # CPU demos
    "small": Preset(layers=4, d_model=128, heads=4, seq_len=128),
    "base": Preset(layers=6, d_model=384, heads=6, seq_len=256),
}


class Block(nn.Module):
    """Pre-LayerNorm: each sublayer sees a normalised input and adds to the residual stream."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_attention = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.projection = nn.Linear(d_model, d_model)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, d_model = x.shape
        qkv = self.qkv(self.ln_attention(x)).view(batch, length, 3, self.heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [batch, heads, length, head_dim]
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.projection(attended.transpose(1, 2).reshape(batch, length, d_model))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    def __init__(self, preset: Preset, generator: torch.Generator) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB, preset.d_model)
        self.position_embedding = nn.Embedding(preset.seq_len, preset.d_model)
        self.blocks = nn.Sequential(
            *(Block(preset.d_model, preset.heads) for _ in range(preset.layers))
        )
        self.ln_final = nn.LayerNorm(preset.d_model)
        # Every weight is redrawn from ``generator`` (GPT-2's N(0, 0.02)), so replicas built
        # with one seed start identical whatever the global RNG did before.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02, generator=generator)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """[batch, length] bytes -> [batch, length, 256] next-byte logits."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.blocks(self.token_embedding(tokens) + self.position_embedding(positions))
        return self.ln_final(x) @ self.token_embedding.weight.T  # head tied to the embedding


def build(context: TaskContext) -> Task:
    options = context.options
    if unknown := sorted(set(options) - set(OPTIONS)):
        raise ValueError(f"task options {unknown} unknown; the gpt task takes {list(OPTIONS)}")
    if (name := options.get("preset", "tiny")) not in PRESETS:
        raise ValueError(f"task preset {name!r} unknown; choose one of {list(PRESETS)}")
    preset = PRESETS[name]
    seq_len = int(options.get("seq_len", preset.seq_len))
    batch_size = int(options.get("batch_size", 16))
    eval_batches = int(options.get("eval_batches", 8))
    if min(seq_len, batch_size, eval_batches) < 1:
        raise ValueError("task options seq_len, batch_size and eval_batches must be at least 1")
    preset = Preset(preset.layers, preset.d_model, preset.heads, seq_len)
    model = GPT(preset, torch.Generator().manual_seed(context.seed)).to(context.device)
    stream = cache(lambda: _stream(context, seq_len, batch_size))  # opened when first read
    device = context.device

    def batches(start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (inputs_and_targets(rows, device) for rows in stream().batches(start))

    def eval_set() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [inputs_and_targets(rows, device) for rows in stream().evaluation(eval_batches)]

    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())

    return Task(model, batches, loss, batch_size * seq_len, held_out_loss(loss, eval_set))


def _stream(context: TaskContext, seq_len: int, batch_size: int) -> Stream:
    """The run's data (run.toml's ``[task] data``, prepared with the ``bytes`` tokenizer, or
    raw text the run prepares with it), else the ``corpus`` option's text, prepared the same
    way into the run's store: ``EVAL_FRACTION`` of its documents held out."""
    options = context.options
    given = sorted({"corpus", "corpus_bytes"} & options.keys())
    if given and context.data is not None and context.data.corpus:
        raise ValueError(
            f"task options {given} and run.toml [task] data both say what to train on: give one"
        )
    return context.stream(
        seq_len, batch_size, ByteTokenizer(), default=options.get("corpus", STDLIB),
        heldout_fraction=EVAL_FRACTION,
        max_bytes=int(options.get("corpus_bytes", CORPUS_BYTES)),
    )  # fmt: skip
