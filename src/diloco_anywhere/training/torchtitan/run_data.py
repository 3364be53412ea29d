"""run.toml's ``[task] data`` as torchtitan's data loader (``RunDataLoader``): the run's one
order of the prepared corpus, claimed in the bucket at each round as for every task
(docs/data.md), read with the job's own tokenizer.

The job's config gets ``RunDataLoader.Config`` in place of its own loader's (``job.py``), so
torchtitan builds this loader, not the job's, whose dataset may be a download of its own (the
Llama configs' ``c4``). It yields nothing until the replica has joined the run and given it
the run's batches (``read``); its position is the run's claims, not a state of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader

from diloco_anywhere.data.stream import Stream
from diloco_anywhere.training.training import Training

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]  # torchtitan's (inputs, labels)


class RunDataLoader(BaseDataLoader):
    """The run's batches for torchtitan's loop, once ``read`` has them."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        """Nothing to set: the data is run.toml's ``[task] data``."""

    def __init__(self, config: Config, **built_with: Any) -> None:
        """``built_with``: what torchtitan's ``Trainer`` builds every loader with (its data
        parallel rank and world, tokenizer, sequence length, batch): the run's stream is sized
        from the job's config instead, and a replica's ranks share its claims."""
        self.config = config
        self._batches: Iterator[Batch] | None = None

    def read(self, batches: Iterator[Batch]) -> None:
        """Yield ``batches`` from here on (``run_batches``)."""
        self._batches = batches

    def __iter__(self) -> Iterator[Batch]:
        if self._batches is None:
            raise RuntimeError("the run's data is read once the replica has joined the run")
        return self._batches

    def state_dict(self) -> dict[str, Any]:
        """Nothing: the run's claims in the bucket say where its data is."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: a healed replica's batches reopen at the run's step."""


class JobTokenizer:
    """The job's tokenizer (torchtitan's ``HuggingFaceTokenizer``, read from its
    ``hf_assets_path``) as ``data/tokenizers.HfTokenizer`` reads one: the run's raw text is
    prepared with it, and a prepared corpus must have been, so that its ids are the model's
    (a corpus of another tokenizer is refused, naming both)."""

    def __init__(self, tokenizer: Any) -> None:
        self.backend_tokenizer, self.eos_token_id = tokenizer.tokenizer, tokenizer.eos_id

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)


def run_batches(training: Training, stream: Stream, sequences: int) -> Iterator[Batch]:
    """The run's data as torchtitan's batches: each optimizer step's sequences (``stream``),
    split into its micro-batches of ``sequences``, each ``({"input": tokens, "positions":
    positions}, labels)``, reopened where the run is after a heal (``training.batches``). The
    positions run 0 to ``seq_len - 1`` along each sequence: causal attention over the packed
    documents, as the built-in tasks train (torchtitan's own loader restarts them at each
    document, which its attention masks then keep apart)."""
    positions = torch.arange(stream.shape.seq_len).expand(sequences, -1)
    for batch in training.batches(stream.batches):
        for micro in batch.split(sequences):
            yield {"input": micro[:, :-1], "positions": positions}, micro[:, 1:]
