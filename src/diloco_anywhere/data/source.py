"""The run's data as a task or a script opens it: run.toml's ``[task] data``, a prepared corpus.

A task knows its sequence length and batch; the replica knows its round length, the run's
seed and who decides which units it trains (``claims.py`` through the bucket, or a fixed share
where there is none). ``DataSource`` brings the two together: ``open(seq_len, batch_sequences)``
reads the corpus's manifest (a few hundred bytes a shard), agrees on the run's data plan and
returns the process's ``Stream``, without reading a token yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import crc32c

from diloco_anywhere.bucket.record import encode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.data.claims import DataPlan
from diloco_anywhere.data.manifest import Manifest
from diloco_anywhere.data.order import Order
from diloco_anywhere.data.reader import TokenReader, read_manifest
from diloco_anywhere.data.stream import WINDOW_CHUNKS, Stream, StreamShape
from diloco_anywhere.data.tokenizers import TokenizerIdentity

# Given the run's data plan: the unit this process trains in a round.
Assigner = Callable[[DataPlan], Callable[[int], int]]


def fixed_units(replica_index: int, replicas: int, rank: int, ranks: int) -> Assigner:
    """Without a bucket to claim in (a task built outside a run, e.g. by a benchmark): process
    ``rank`` of replica ``replica_index`` trains unit ``(round x replicas + index) x ranks +
    rank``, the share a run of fixed replicas that all contribute to every round would have."""

    def assign(_plan: DataPlan) -> Callable[[int], int]:
        return lambda round_: (round_ * replicas + replica_index) * ranks + rank

    return assign


def same_tokens(ours: TokenizerIdentity, theirs: TokenizerIdentity) -> bool:
    """Whether two tokenizers encode alike, whatever name each was loaded by."""
    return (ours.sha256, ours.vocab, ours.end_of_document) == (
        theirs.sha256, theirs.vocab, theirs.end_of_document,
    )  # fmt: skip


@dataclass(frozen=True)
class DataSource:
    corpus: str  # the prepared corpus's folder: a store URL or an absolute path
    seed: int
    batches_per_round: int
    rounds: int | None  # the run's rounds: no unit is claimed past them
    assign: Assigner

    def manifest(self) -> tuple[Store, Manifest]:
        store = Store(self.corpus)
        return store, read_manifest(store)

    def open(
        self, seq_len: int, batch_sequences: int, tokenizer: TokenizerIdentity | None = None
    ) -> Stream:
        """This process's stream of ``batch_sequences`` sequences of ``seq_len + 1`` tokens a
        step; ``tokenizer``: the one the task encodes with, which must be the corpus's."""
        store, manifest = self.manifest()
        if tokenizer is not None and not same_tokens(tokenizer, manifest.settings.tokenizer):
            raise ValueError(
                f"the corpus at {self.corpus} was prepared with tokenizer "
                f"{manifest.settings.tokenizer.name!r} (sha256 "
                f"{manifest.settings.tokenizer.sha256[:12]}...), the task's is "
                f"{tokenizer.name!r} ({tokenizer.sha256[:12]}...): prepare it again with the "
                f"task's tokenizer, or give the task that one"
            )
        shape = StreamShape(seq_len, batch_sequences, self.batches_per_round)
        train = TokenReader(store, manifest, "train")
        order = Order.of(
            train.tokens, seq_len, manifest.settings.block_tokens, WINDOW_CHUNKS, self.seed
        )
        plan = DataPlan(
            corpus=self.corpus, manifest_crc32c=crc32c.crc32c(encode_record(manifest)),
            seq_len=seq_len, unit_sequences=shape.unit_sequences,
            chunk_sequences=order.chunk_sequences, window_chunks=order.window_chunks,
            seed=self.seed,
        )  # fmt: skip
        heldout = TokenReader(store, manifest, "heldout")
        return Stream(train, heldout, order, shape, self.assign(plan), self.rounds)
