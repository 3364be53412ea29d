"""The run's one order of training sequences: every sequence once per epoch, whatever the
number of replicas.

The split's tokens, taken end to end, are cut into sequences of ``seq_len + 1`` tokens at a
stride of ``seq_len`` (each sequence's targets are its inputs shifted by one). Sequences are
grouped in chunks of ``chunk_sequences`` consecutive ones (about one checksummed block of
tokens, so one ranged read serves a chunk; smaller in a corpus of fewer than ``MIN_CHUNKS``
blocks), and the sequences left over after the last whole
chunk, fewer than a chunk's, are not trained. The order is an endless stream of positions:
position ``p`` is in epoch ``p // sequences``; each epoch visits the chunks in a keyed random
permutation of its own and, within each window of ``window_chunks`` consecutive chunks of that
permutation, their sequences in a second one. This is MosaicML streaming's two-level shuffle
(shards, then samples within a shuffle block): batches mix sequences from many places in the
corpus while a reader fetches whole chunks.

The permutations are Feistel networks over the index with cycle walking (Black and Rogaway,
"Ciphers with Arbitrary Finite Domains", 2002): any position maps to its sequence in O(1)
without a table, so the order costs no memory whatever the corpus's size, and it is plain
integer arithmetic, the same on every machine and numpy version. Which replica trains which
part of the stream is decided elsewhere (``claims.py``): the order never depends on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ROUNDS = 4  # Luby-Rackoff: four rounds make a Feistel network a strong pseudorandom permutation
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK64 = 2**64 - 1
MIN_CHUNKS = 256  # a small corpus is cut into chunks smaller than a block, to be shuffled still


def _splitmix(values: np.ndarray, key: int) -> np.ndarray:
    """SplitMix64's finalizer of ``values + key`` (uint64, wrapping): a fast keyed hash."""
    z = values + np.uint64(key & _MASK64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    return z ^ (z >> np.uint64(31))


def key_of(*numbers: int) -> int:
    """One 64-bit key from several whole numbers (seed, epoch, window...)."""
    key = 0
    for number in numbers:
        mixed = _splitmix(np.array([key ^ (number & _MASK64)], dtype=np.uint64), _GOLDEN)
        key = int(mixed[0])
    return key


def permute(indices: np.ndarray, size: int, key: int) -> np.ndarray:
    """The keyed permutation of ``0..size-1`` applied to ``indices``: a bijection, the same for
    the same ``size`` and ``key`` everywhere."""
    half = max(1, ((size - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    keys = [key_of(key, number) for number in range(ROUNDS)]

    def network(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for round_key in keys:
            left, right = right, left ^ (_splitmix(right, round_key) & mask)
        return (left << shift) | right

    values = network(np.asarray(indices, dtype=np.uint64))
    outside = values >= size
    while outside.any():  # cycle walking: the domain is at most 4 x size, so few turns
        values[outside] = network(values[outside])
        outside = values >= size
    return values.astype(np.int64)


@dataclass(frozen=True)
class Order:
    chunks: int  # in an epoch
    chunk_sequences: int
    window_chunks: int
    seed: int

    def __post_init__(self) -> None:
        if min(self.chunks, self.chunk_sequences, self.window_chunks) < 1:
            raise ValueError(f"{self}: chunks, chunk_sequences and window_chunks must be >= 1")

    @classmethod
    def of(cls, tokens: int, seq_len: int, block_tokens: int, window: int, seed: int) -> Order:
        """The order of a split of ``tokens`` tokens; an error saying what to change when it
        holds not even one chunk."""
        sequences = max(0, tokens - 1) // seq_len
        if sequences == 0:
            raise ValueError(
                f"the corpus's {tokens} training tokens hold no sequence of seq_len {seq_len} "
                f"+ 1: give more text or a smaller seq_len"
            )
        chunk_sequences = max(1, min(block_tokens // seq_len, sequences // MIN_CHUNKS))
        return cls(sequences // chunk_sequences, chunk_sequences, window, seed)

    @property
    def epoch_sequences(self) -> int:
        return self.chunks * self.chunk_sequences

    def sequences(self, start: int, stop: int) -> np.ndarray:
        """The sequence numbers at stream positions ``[start, stop)``."""
        positions = np.arange(start, stop, dtype=np.int64)
        epochs, within = np.divmod(positions, self.epoch_sequences)
        window_size = self.window_chunks * self.chunk_sequences
        windows, offsets = np.divmod(within, window_size)
        result = np.empty_like(positions)
        for epoch, window in sorted(set(zip(epochs.tolist(), windows.tolist(), strict=True))):
            here = (epochs == epoch) & (windows == window)
            first_chunk = window * self.window_chunks
            length = min(self.window_chunks, self.chunks - first_chunk) * self.chunk_sequences
            shuffled = permute(offsets[here], length, key_of(self.seed, epoch, window))
            slots, sequence = np.divmod(shuffled, self.chunk_sequences)
            chunks = permute(first_chunk + slots, self.chunks, key_of(self.seed, epoch))
            result[here] = chunks * self.chunk_sequences + sequence
        return result
