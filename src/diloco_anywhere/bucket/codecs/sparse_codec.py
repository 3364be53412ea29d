"""``sparse``: the ``k`` largest magnitudes of every chunk, each sent in a few bits.

SparseLoCo (arXiv 2508.15706, section 3) sends per chunk of 4,096 values the top 64 by
magnitude (1.56%), each in 2 bits, and keeps what it did not send in an error-feedback buffer
that it sends later (``feedback.py``); Templar's Covenant-72B run sent 1.56% of its gradients
this way over object storage. The default here keeps 8% (328 of 4,096), the most that fits
1/50 of fp32, which measured better at this project's scale (docs/tuning.md, "Sparse").
Without error feedback the values left out would be lost, so a run sends ``sparse`` only
with it (``training/managers/bucket.py``).

A value kept is a sign bit and ``bits - 1`` bits naming one of the chunk's ``2**(bits - 1)``
magnitude levels. The levels are the chunk's own codebook, fitted to its kept magnitudes by a
few Lloyd-Max steps (from levels evenly spread between the smallest and the largest), as
SparseLoCo's quantizer reconstructs each bin at the mean of what fell in it. On the top 64
of 4,096 magnitudes this halves the quantization error of a linear grid at 2 bits (6.2%
against 11.8% on Gaussian values, 19% against 28% on Student-t(3)); with one level it is the
mean magnitude, a scaled sign.

Payload for ``n`` values in ``c = ceil(n / chunk)`` chunks, the last of which may be short
(it keeps ``min(k, its length)``):

1. per chunk, its ``2**(bits - 1)`` magnitude levels, float32;
2. per chunk, its kept positions within the chunk, ascending, in Elias-Fano form
   (``elias_fano.py``: about ``2 + log2(chunk / k)`` bits each), the row padded to a byte;
3. per chunk, each kept value's ``bits`` bits (its level, then the sign in the top bit), in the
   same order, the row padded to a byte.

At the defaults a chunk of 16 KiB of float32 takes 8 + 228 + 82 = 318 bytes: 1/51 of fp32
(SparseLoCo's 64 of 4,096: 8 + 64 + 16 = 88 bytes, 1/186).
Reading trusts nothing: positions in range and strictly ascending within their chunk (no
position twice), every level finite and at least 0; the payload's length is fixed by ``n`` and
the parameters, so every count and size follows from the header. Encoding is deterministic
(reductions, no atomics), so a replica encoding its tensors again gets the bytes it sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator

from diloco_anywhere.bucket.codecs import bitpack, codec_base, elias_fano
from diloco_anywhere.bucket.codecs.codec_base import CPU, CodecBase, CodecDataError

LLOYD_STEPS = 3  # refinements of a chunk's levels: 3 from an even spread match 6 from means


@dataclass(frozen=True)
class _Rows:
    """Chunks of one length in a range: elements ``[first, first + count * length)`` of the
    range, with their host views of the payload."""

    first: int
    count: int
    length: int
    kept: int
    levels: torch.Tensor  # count x levels, float32
    positions: torch.Tensor  # count x row bytes, uint8
    codes: torch.Tensor  # count x row bytes, uint8


class SparseCodec(CodecBase):
    """Per-chunk top-``k`` with ``bits``-bit values (see the module docstring)."""

    name: Literal["sparse"] = "sparse"
    chunk: int = Field(default=4096, ge=64, le=65536)
    k: int = Field(default=328, ge=1, le=65536)  # 8%: the most that fits 1/50 of fp32
    bits: int = Field(default=2, ge=1, le=4)
    contiguous: ClassVar[bool] = False

    @model_validator(mode="after")
    def _fits(self) -> SparseCodec:
        if self.chunk % 64:
            raise ValueError(f"chunk ({self.chunk}) must be a multiple of 64")
        if self.k > self.chunk:
            raise ValueError(f"k ({self.k}) must be at most chunk ({self.chunk})")
        return self

    @property
    def align(self) -> int:
        return self.chunk

    @property
    def levels(self) -> int:
        """Magnitude levels per chunk: what the bits other than the sign can name."""
        return 1 << (self.bits - 1)

    def _row_bytes(self, length: int) -> tuple[int, int]:
        """(position bytes, code bytes) of a chunk of ``length`` values."""
        if length == 0:
            return 0, 0
        kept = min(self.k, length)
        return elias_fano.row_bytes(kept, length), bitpack.row_bytes(kept, self.bits)

    def _chunk_bytes(self, length: int) -> int:
        return 4 * self.levels + sum(self._row_bytes(length))

    def payload_nbytes(self, numel: int) -> int:
        full, tail = divmod(numel, self.chunk)
        return full * self._chunk_bytes(self.chunk) + (self._chunk_bytes(tail) if tail else 0)

    def _rows(self, payload: memoryview, numel: int, start: int, stop: int) -> list[_Rows]:
        """The chunks of elements ``[start, stop)`` (``start`` on a chunk), grouped by length:
        the whole chunks, then the object's short last chunk if the range ends with it."""
        chunks, full = -(-numel // self.chunk), numel // self.chunk
        tail = numel - full * self.chunk
        row_positions, row_codes = self._row_bytes(self.chunk)
        positions_at = 4 * self.levels * chunks  # where each area of the payload starts
        codes_at = positions_at + full * row_positions + self._row_bytes(tail)[0]
        first, groups = start // self.chunk, []
        whole = (min(stop, full * self.chunk) - start) // self.chunk
        for chunk, count, length in (
            (first, whole, self.chunk),
            (full, int(stop == numel and tail > 0), tail),
        ):
            if count == 0:
                continue
            position_bytes, code_bytes = self._row_bytes(length)
            areas = (  # (dtype, items, byte offset) of this group in each area
                (torch.float32, self.levels * count, 4 * self.levels * chunk),
                (torch.uint8, count * position_bytes, positions_at + chunk * row_positions),
                (torch.uint8, count * code_bytes, codes_at + chunk * row_codes),
            )
            levels, positions, codes = (
                codec_base.host_view(payload, *area).view(count, -1) for area in areas
            )
            kept = min(self.k, length)
            groups.append(
                _Rows((chunk - first) * self.chunk, count, length, kept, levels, positions, codes)
            )
        return groups

    # -- encoding ----------------------------------------------------------------------------

    @staticmethod
    def _nearest(magnitudes: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        """Each of ``magnitudes`` (rows x m): the index of its nearest of ``levels`` (each row
        ascending, as Lloyd-Max steps from ascending levels keep them): how many of the
        midpoints between neighbouring levels it lies above."""
        midpoints = (levels[:, 1:] + levels[:, :-1]) / 2
        return (magnitudes.unsqueeze(-1) > midpoints.unsqueeze(1)).sum(-1)

    def _fit_levels(self, magnitudes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's levels for its ``magnitudes`` (rows x m), and each magnitude's level:
        evenly spaced from the row's smallest to its largest, then ``LLOYD_STEPS`` Lloyd-Max
        steps (each magnitude to its nearest level, each level to the mean of its
        magnitudes; a level that draws none stays). Sums over one-hot masks, not scatters:
        deterministic on GPUs."""
        if self.levels == 1:  # the mean, which minimises a sign's squared error: no search
            return magnitudes.mean(1, keepdim=True), torch.zeros_like(magnitudes, dtype=torch.int64)
        names = torch.arange(self.levels, device=magnitudes.device)
        low, high = magnitudes.amin(1, keepdim=True), magnitudes.amax(1, keepdim=True)
        fitted = low + (high - low) * (names / (self.levels - 1))
        for _ in range(LLOYD_STEPS):
            members = (self._nearest(magnitudes, fitted).unsqueeze(-1) == names).float()
            counts = members.sum(1)
            means = (magnitudes.unsqueeze(-1) * members).sum(1) / counts.clamp(min=1)
            fitted = torch.where(counts > 0, means, fitted)
        return fitted, self._nearest(magnitudes, fitted)

    def _encode_rows(
        self, values: torch.Tensor, kept: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(levels, packed positions, packed codes) of ``values`` (rows x chunk length). The
        kept positions come in ascending order from a mask of them (cheaper than sorting)."""
        rows, length = values.shape
        chosen = torch.zeros(rows, length, dtype=torch.bool, device=values.device)
        chosen.scatter_(1, torch.topk(values.abs(), kept, dim=1, sorted=False).indices, True)
        positions = chosen.nonzero()[:, 1].view(rows, kept)
        kept_values = values.gather(1, positions)
        levels, assigned = self._fit_levels(kept_values.abs())
        codec_base.require_finite(levels, "sparse levels (beyond float32?)", ValueError)
        codes = assigned | ((kept_values < 0).to(torch.int64) << (self.bits - 1))
        return (
            levels,
            elias_fano.encode(positions, length),
            bitpack.pack(codes, self.bits),
        )

    def encode_range(
        self, values: torch.Tensor, payload: memoryview, numel: int, start: int
    ) -> None:
        """Elements ``[start, start + len(values))`` of a ``numel``-element object."""
        for rows in self._rows(payload, numel, start, start + values.numel()):
            chunk_values = values[rows.first : rows.first + rows.count * rows.length]
            levels, positions, codes = self._encode_rows(
                chunk_values.view(rows.count, rows.length), rows.kept
            )
            codec_base.to_host(levels, rows.levels)
            codec_base.to_host(positions, rows.positions)
            codec_base.to_host(codes, rows.codes)

    # -- decoding ----------------------------------------------------------------------------

    def _positions(self, rows: _Rows, device: torch.device) -> torch.Tensor:
        """The kept positions of ``rows``; ``CodecDataError`` unless each chunk's are strictly
        ascending and inside it (checked before anything is written at them)."""
        positions = elias_fano.decode(rows.positions.to(device), rows.kept, rows.length)
        if bool((positions[:, 1:] <= positions[:, :-1]).any()):
            raise CodecDataError(
                "sparse positions must be strictly ascending within each chunk (none twice)"
            )
        if bool((positions[:, -1] >= rows.length).any()):
            raise CodecDataError(
                f"sparse position beyond its chunk of {rows.length} values "
                f"(positions go from 0 to {rows.length - 1})"
            )
        return positions

    def decode_range(
        self, payload: memoryview, numel: int, start: int, stop: int, device: torch.device = CPU
    ) -> torch.Tensor:
        """Float32 values of elements ``[start, stop)`` on ``device``: zero where no value was
        kept. ``CodecDataError`` for positions outside their chunk or given twice."""
        values = torch.zeros(stop - start, device=device)
        for rows in self._rows(payload, numel, start, stop):
            positions = self._positions(rows, device)
            codes = bitpack.unpack(rows.codes.to(device), self.bits, rows.kept)
            magnitudes = rows.levels.to(device).gather(1, codes & (self.levels - 1))
            signed = torch.where(codes >> (self.bits - 1) == 1, -magnitudes, magnitudes)
            chunk_values = values[rows.first : rows.first + rows.count * rows.length]
            chunk_values.view(rows.count, rows.length).scatter_(1, positions, signed)
        return values

    def check(self, payload: memoryview, numel: int, start: int, values: torch.Tensor) -> None:
        """``CodecDataError`` unless every level is finite and at least 0."""
        for rows in self._rows(payload, numel, start, start + values.numel()):
            codec_base.require_finite(rows.levels, "sparse levels")
            if bool((rows.levels < 0).any()):
                raise CodecDataError("sparse levels must be >= 0 (they are magnitudes)")
        codec_base.require_finite(values, "sparse payload")
