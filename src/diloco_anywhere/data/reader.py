"""The tokens of one split of a prepared corpus, read from its store by ranged reads.

A replica reads only what it trains on: a token range becomes one ranged read per shard it
touches, of the whole checksummed blocks (``shards.py``) that cover it, after the shard's header
(one small ranged read, checked against the manifest). Headers and blocks are kept in bounded
caches, so what a reader holds does not grow with the corpus: a 50B-token corpus in 2^26-token
shards is about 750 headers of 40 KB, of which ``HEADERS_KEPT`` stay.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

import numpy as np

from diloco_anywhere.bucket.errors import StoreError
from diloco_anywhere.bucket.format.record import RECORD_READ_LIMIT, decode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.data.manifest import MANIFEST, Manifest, ShardEntry
from diloco_anywhere.data.shards import ShardHeader, Split, decode_blocks, decode_header

HEADERS_KEPT = 64
BLOCK_CACHE_BYTES = 64 << 20
V = TypeVar("V")


class CorpusNotPreparedError(ValueError):
    """No finished manifest where the run's data should be."""


def read_manifest(store: Store) -> Manifest:
    """The finished corpus in ``store``'s folder; an error saying how to prepare it if none."""
    try:
        data = store.get(MANIFEST, 0, RECORD_READ_LIMIT)
    except FileNotFoundError:
        raise CorpusNotPreparedError(
            f"{store.url} holds no prepared corpus (no {MANIFEST}): prepare one with "
            f"`diloco data prepare CORPUS {store.url} --tokenizer NAME`, or wait for the "
            f"prepare writing there to finish"
        ) from None
    return decode_record(data, Manifest, key=f"{store.url}/{MANIFEST}")


class _Kept(Generic[V]):
    """A least-recently-used cache bounded by a total size; safe across threads."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.size = capacity, 0
        self._items: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: Hashable, value: V, size: int = 1) -> None:
        with self._lock:
            if key in self._items:
                return
            self._items[key] = (value, size)
            self.size += size
            while self.size > self.capacity and len(self._items) > 1:
                _, (_, dropped) = self._items.popitem(last=False)
                self.size -= dropped


class TokenReader:
    """Tokens ``[start, stop)`` of the split's shards taken end to end, as a numpy array of
    the corpus's dtype; every byte checked before it is returned (``WireFormatError`` naming
    the shard otherwise)."""

    def __init__(
        self, store: Store, manifest: Manifest, split: Split, cache_bytes: int = BLOCK_CACHE_BYTES
    ) -> None:
        self.store, self.split = store, split
        self.shards: list[ShardEntry] = manifest.shards(split)
        self.starts = np.cumsum([0] + [shard.tokens for shard in self.shards]).tolist()
        self.block_tokens = manifest.settings.block_tokens
        self.dtype = np.dtype(manifest.settings.dtype).newbyteorder("<")
        self._headers: _Kept[ShardHeader] = _Kept(HEADERS_KEPT)
        self._blocks: _Kept[np.ndarray] = _Kept(cache_bytes)

    @property
    def tokens(self) -> int:
        return self.starts[-1]

    def read(self, start: int, stop: int) -> np.ndarray:
        if not 0 <= start <= stop <= self.tokens:
            raise ValueError(f"tokens [{start}, {stop}) of the {self.split} split's {self.tokens}")
        pieces = []
        shard = bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            end = min(stop, self.starts[shard + 1])
            offset = self.starts[shard]
            pieces.append(self._from_shard(shard, start - offset, end - offset))
            start, shard = end, shard + 1
        return np.concatenate(pieces) if len(pieces) != 1 else pieces[0]

    def _from_shard(self, shard: int, start: int, stop: int) -> np.ndarray:
        size = self.block_tokens
        first, last = start // size, (stop - 1) // size
        blocks = self._blocks_of(shard, first, last)
        return blocks[start - first * size : stop - first * size]

    def _blocks_of(self, shard: int, first: int, last: int) -> np.ndarray:
        """Blocks ``first..last`` of a shard, from the cache or one ranged read of them all."""
        kept = [self._blocks.get((shard, block)) for block in range(first, last + 1)]
        if all(block is not None for block in kept):
            return np.concatenate(kept) if len(kept) != 1 else kept[0]  # type: ignore[arg-type]
        entry, header = self.shards[shard], self._header(shard)
        itemsize, size = self.dtype.itemsize, self.block_tokens
        begin = entry.payload_offset + first * size * itemsize
        end = entry.payload_offset + min((last + 1) * size, header.tokens) * itemsize
        tokens = decode_blocks(self._get(entry, begin, end), header, first, self._where(entry))
        for block in range(first, last + 1):
            part = tokens[(block - first) * size : (block - first + 1) * size]
            self._blocks.put((shard, block), part, part.nbytes)
        return tokens

    def _header(self, shard: int) -> ShardHeader:
        header = self._headers.get(shard)
        if header is None:
            entry = self.shards[shard]
            data = self._get(entry, 0, entry.payload_offset)
            header = decode_header(data, self._where(entry), entry.header_crc32c)
            if (header.tokens, header.block_tokens) != (entry.tokens, self.block_tokens):
                raise ValueError(
                    f"{self._where(entry)}: {header.tokens} tokens in blocks of "
                    f"{header.block_tokens}; the manifest says {entry.tokens} in blocks of "
                    f"{self.block_tokens}"
                )
            self._headers.put(shard, header)
        return header

    def _get(self, entry: ShardEntry, start: int, end: int) -> bytes:
        try:
            return self.store.get(entry.key, start, end)
        except FileNotFoundError:
            raise StoreError(
                f"{self._where(entry)} is missing, though the corpus's manifest lists it: the "
                f"corpus was changed or partly deleted; prepare it again into a new folder"
            ) from None

    def _where(self, entry: ShardEntry) -> str:
        return f"{self.store.url}/{entry.key}"
