"""The run's data as a task or a script opens it: run.toml's ``[task] data``.

A task knows its sequence length, batch and tokenizer; the replica knows its round length, the
run's seed, its store and who decides which units it trains (``claims.py`` through the bucket,
or a fixed share where there is none). ``DataSource`` brings the two together:
``open(seq_len, batch_sequences, tokenizer)`` finds the prepared corpus (the one named, or the
run's copy of raw text, prepared once by the first replica: ``prepare_once.py``), reads its
manifest (a few hundred bytes a shard), agrees on the run's data plan and returns the
process's ``Stream``, without reading a token yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import crc32c

from diloco_anywhere.bucket.format.record import encode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import ConfigError
from diloco_anywhere.data.claims import DataPlan, share
from diloco_anywhere.data.defaults import BLOCK_TOKENS, HELDOUT_FRACTION, SHARD_TOKENS
from diloco_anywhere.data.manifest import Manifest
from diloco_anywhere.data.order import Order
from diloco_anywhere.data.prepare import settings_for
from diloco_anywhere.data.prepare_once import is_prepared, prepare_once
from diloco_anywhere.data.reader import TokenReader, read_manifest
from diloco_anywhere.data.stream import WINDOW_CHUNKS, SpanOf, Stream, StreamShape, UnitsOf
from diloco_anywhere.data.tokenizers import ByteTokenizer, HfTokenizer, TokenizerIdentity

# Given the run's data plan: the units this process trains in a round.
Assigner = Callable[[DataPlan], UnitsOf]


def fixed_units(replica_index: int, replicas: int, rank: int, ranks: int) -> Assigner:
    """Without a bucket to claim in (a task built outside a run, e.g. by a benchmark): process
    ``rank`` of replica ``replica_index`` trains its units of the replica's ``share``, as in a
    run of fixed replicas that all contribute to every round."""

    def assign(_plan: DataPlan) -> UnitsOf:
        def units_of(round_: int, count: int) -> list[int]:
            return list(share(round_, replicas, replica_index, ranks * count)[rank::ranks])

        return units_of

    return assign


def same_tokens(ours: TokenizerIdentity, theirs: TokenizerIdentity) -> bool:
    """Whether two tokenizers encode alike, whatever name each was loaded by."""
    return (ours.sha256, ours.vocab, ours.end_of_document) == (
        theirs.sha256, theirs.vocab, theirs.end_of_document,
    )  # fmt: skip


@dataclass(frozen=True)
class RawText:
    """How raw text is prepared for a run: what a task says of its own data."""

    text_field: str
    heldout_fraction: float
    max_bytes: int | None  # of the task's own text (``default``): its first files up to it


@dataclass
class DataUse:
    """Whether a replica opened the run's data (``DataSource.open``): a script that never does
    trains on data of its own, which the run claims none of, and status says so."""

    opened: bool = False


@dataclass(frozen=True)
class DataSource:
    corpus: str  # run.toml's [task] data: a prepared folder or raw text ("": the task's own)
    seed: int
    batches_per_unit: int  # a unit of the run's data: this many steps of one process
    assign: Assigner
    span_of: SpanOf | None = None  # the rounds of the replica's steps: one unit each, if None
    copy: str | None = None  # where raw text is prepared for the run (none outside a run)
    holder: str = "this process"  # who prepares it here, as waiters are told
    use: DataUse = field(default_factory=DataUse)  # the replica's, told when a stream opens

    def open(
        self, seq_len: int, batch_sequences: int,
        tokenizer: ByteTokenizer | HfTokenizer | None = None, *, default: str = "",
        text_field: str = "text", heldout_fraction: float = HELDOUT_FRACTION,
        max_bytes: int | None = None,
    ) -> Stream:  # fmt: skip
        """This process's stream of ``batch_sequences`` sequences of ``seq_len + 1`` tokens a
        step, of the run's data or else ``default`` (the task's own); raw text (its first files
        up to ``max_bytes``) is prepared with ``tokenizer`` (and ``text_field``,
        ``heldout_fraction``) into the run's copy, and a prepared corpus must have been
        prepared with it (any, without one)."""
        self.use.opened = True
        raw = RawText(text_field, heldout_fraction, max_bytes)
        store, manifest = self._corpus(tokenizer, default, raw)
        theirs = manifest.settings.tokenizer
        if tokenizer is not None and not same_tokens(tokenizer.identity, theirs):
            # a mistake no restart can fix (exit 2, the replica's own): a tokenizer of another
            # vocabulary, or of the same size with other ids, would train on garbage
            raise ConfigError(
                f"the corpus at {store.url} was prepared with tokenizer {theirs.name!r} (sha256 "
                f"{theirs.sha256[:12]}...), the task's is {tokenizer.identity.name!r} "
                f"({tokenizer.identity.sha256[:12]}...): prepare it again with the task's "
                f"tokenizer, or give the task that one"
            )
        shape = StreamShape(seq_len, batch_sequences, self.batches_per_unit)
        train = TokenReader(store, manifest, "train")
        order = Order.of(
            train.tokens, seq_len, manifest.settings.block_tokens, WINDOW_CHUNKS, self.seed
        )
        plan = DataPlan(
            corpus=store.url, manifest_crc32c=crc32c.crc32c(encode_record(manifest)),
            seq_len=seq_len, unit_sequences=shape.unit_sequences,
            epoch_sequences=order.epoch_sequences, chunk_sequences=order.chunk_sequences,
            window_chunks=order.window_chunks, seed=self.seed,
        )  # fmt: skip
        heldout = TokenReader(store, manifest, "heldout")
        return Stream(train, heldout, order, shape, self.assign(plan), self.span_of)

    def _corpus(
        self, tokenizer: ByteTokenizer | HfTokenizer | None, default: str, raw: RawText
    ) -> tuple[Store, Manifest]:
        """The prepared corpus to read: the one named, or the run's copy of raw text."""
        url = self.corpus or default
        if not url:
            raise ValueError(
                "no training data: set run.toml [task] data to a corpus (raw text, or a folder "
                "`diloco data prepare` wrote)"
            )
        if is_prepared(url):
            store = Store(url)
            return store, read_manifest(store)
        if self.copy is None or tokenizer is None:
            name = "NAME" if tokenizer is None else tokenizer.identity.name
            raise ValueError(
                f"{url} is raw text, which a run's replicas prepare into its store with their "
                f"task's tokenizer (a script gives it: replica.stream(..., tokenizer=NAME)); or "
                f"prepare it with `diloco data prepare {url} FOLDER --tokenizer {name}` and "
                f"give FOLDER"
            )
        settings = settings_for(
            tokenizer, raw.text_field, raw.heldout_fraction, SHARD_TOKENS, BLOCK_TOKENS
        )
        store = Store(self.copy)
        max_bytes = None if self.corpus else raw.max_bytes  # the task's own text's cap
        manifest = prepare_once(url, store, tokenizer, settings, self.holder, max_bytes=max_bytes)
        return store, manifest
