"""The built-in task: a byte-level GPT trained on text that every machine already has.

The default corpus is the running interpreter's own standard library (its ``.py`` sources), so a
demo needs no download and no credentials. Replicas only agree on the corpus, and so on the eval
split, if they run the same Python version; give ``corpus`` a shared file or URL otherwise.

The model is GPT-2's decoder (Radford et al. 2019 (GPT-2)): pre-LayerNorm blocks, a final
LayerNorm, and an output head tied to the token embedding. Bytes are the tokens (vocabulary 256),
so no tokenizer has to be shipped or agreed on.

``[task.options]``: ``preset`` (tiny | small | base), ``seq_len``, ``batch_size``, ``corpus``
("stdlib", a path or an fsspec URL of one text file), ``corpus_bytes`` (cap on what is read) and
``eval_batches``.
"""

from __future__ import annotations

import itertools
import os
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import fsspec
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from diloco_anywhere.data.tokenizers import ByteTokenizer
from diloco_anywhere.task import (
    Task,
    TaskContext,
    batch_generator,
    held_out_loss,
    inputs_and_targets,
    windows,
)

VOCAB = 256  # one token per byte value
EVAL_FRACTION = 0.05
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


def stdlib_files() -> list[Path]:
    """The standard library's .py files in sorted order, without site-packages and tests."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [
            name for name in subdirectories if name not in ("site-packages", "test", "tests")
        ]
        files.extend(Path(directory, name) for name in names if name.endswith(".py"))
    return sorted(files)


def load_corpus(corpus: str, limit: int) -> torch.Tensor:
    """The first ``limit`` bytes of the corpus as a uint8 tensor."""
    data = bytearray()
    if corpus == "stdlib":
        for path in stdlib_files():
            if len(data) >= limit:
                break
            data += path.read_bytes() + b"\n"
    else:
        try:
            with fsspec.open(corpus, "rb") as file:
                data += file.read(limit)
        except FileNotFoundError:
            raise ValueError(
                f"task corpus {corpus!r} not found; set corpus to 'stdlib' or to the local path "
                f"or fsspec URL (e.g. s3://bucket/file.txt) of one text file"
            ) from None
    del data[limit:]
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


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
    if context.data is not None:
        batches, eval_set = _streamed(context, seq_len, batch_size, eval_batches)
    else:
        batches, eval_set = _in_memory(context, seq_len, batch_size, eval_batches)

    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())

    return Task(model, batches, loss, batch_size * seq_len, held_out_loss(loss, eval_set))


Batches = Callable[[int], Iterator[tuple[torch.Tensor, torch.Tensor]]]


def _streamed(
    context: TaskContext, seq_len: int, batch_size: int, eval_batches: int
) -> tuple[Batches, list[tuple[torch.Tensor, torch.Tensor]]]:
    """run.toml's ``[task] data``, streamed: a corpus prepared with the ``bytes`` tokenizer, or
    raw text the run prepares with it (``EVAL_FRACTION`` of its documents held out)."""
    if given := sorted({"corpus", "corpus_bytes"} & set(context.options)):
        raise ValueError(
            f"task options {given} and run.toml [task] data both say what to train on: give one"
        )
    stream = context.stream(seq_len, batch_size, ByteTokenizer(), heldout_fraction=EVAL_FRACTION)
    device = context.device

    def batches(start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (inputs_and_targets(rows, device) for rows in stream.batches(start))

    return batches, [inputs_and_targets(rows, device) for rows in stream.evaluation(eval_batches)]


def _in_memory(
    context: TaskContext, seq_len: int, batch_size: int, eval_batches: int
) -> tuple[Batches, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The ``corpus`` option's text, held in memory: this replica's slice of it, windows
    drawn at random."""
    options = context.options
    corpus = options.get("corpus", "stdlib")
    data = load_corpus(corpus, int(options.get("corpus_bytes", 8_000_000)))
    train_end = len(data) - int(len(data) * EVAL_FRACTION)
    shard_bytes = train_end // context.replicas
    shard = data[context.replica_index * shard_bytes :][:shard_bytes]
    held_out = data[train_end:]
    if shard_bytes < seq_len + 1:
        raise ValueError(
            f"task corpus {corpus!r} ({len(data)} bytes) is too small for {context.replicas} "
            f"replicas: each shard has {shard_bytes} bytes, fewer than seq_len + 1 = {seq_len + 1}"
        )
    if len(held_out) < seq_len + 1:
        raise ValueError(
            f"task corpus {corpus!r} ({len(data)} bytes) is too small: its eval split has "
            f"{len(held_out)} bytes, fewer than seq_len + 1 = {seq_len + 1}"
        )

    def batches(start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index in itertools.count(start):
            generator = batch_generator(context, index)
            offsets = torch.randint(len(shard) - seq_len, (batch_size,), generator=generator)
            yield windows(shard, offsets, seq_len, context.device)

    # Evenly spaced windows over the eval split: the same on every replica and every call.
    last = len(held_out) - seq_len - 1  # float64: exact offsets even in a multi-GB corpus
    offsets = torch.linspace(0, last, eval_batches * batch_size, dtype=torch.float64).long()
    eval_set = [
        windows(held_out, part, seq_len, context.device) for part in offsets.split(batch_size)
    ]
    return batches, eval_set
