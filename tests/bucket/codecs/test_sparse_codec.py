"""The sparse codec: what it keeps, how exactly, in how few bytes, and every read checked."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco_anywhere.bench.store import sample_tensor
from diloco_anywhere.bucket.codecs import bitpack, elias_fano
from diloco_anywhere.bucket.codecs.codec import Int8Codec, make_codec, reduced_codec
from diloco_anywhere.bucket.codecs.sparse_codec import SparseCodec
from diloco_anywhere.bucket.format import framing, wire
from support.wire import craft, header_of

META = wire.ObjectMeta(run="r", round=0, replica="a", incarnation=0, shard=0)
KEY = "run/rounds/0000000001/0/parts/a-0/0"


def round_trip(tensor: torch.Tensor, codec: SparseCodec) -> torch.Tensor:
    return wire.decode(bytes(wire.encode(tensor, codec, META))).tensor


@settings(max_examples=100)
@given(
    bits=st.integers(1, 16),
    rows=st.integers(0, 4),
    count=st.integers(1, 70),
    seed=st.integers(0, 2**31),
)
def test_packed_integers_come_back_and_each_row_starts_on_a_byte(bits, rows, count, seed):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 2**bits, (rows, count), generator=generator)
    packed = bitpack.pack(values, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (rows, bitpack.row_bytes(count, bits))
    assert torch.equal(bitpack.unpack(packed, bits, count), values)


@settings(max_examples=80)
@given(data=st.data(), universe=st.integers(1, 4096), rows=st.integers(1, 3))
def test_ascending_positions_come_back_from_their_elias_fano_form(data, universe, rows):
    count = data.draw(st.integers(1, universe))
    seeds = data.draw(st.lists(st.integers(0, 2**31), min_size=rows, max_size=rows))
    positions = torch.stack([
        torch.randperm(universe, generator=torch.Generator().manual_seed(seed))[:count].sort()[0]
        for seed in seeds
    ])  # fmt: skip
    packed = elias_fano.encode(positions, universe)
    assert packed.shape == (rows, elias_fano.row_bytes(count, universe))
    assert torch.equal(elias_fano.decode(packed, count, universe), positions)


def test_elias_fano_takes_two_bits_and_the_log_of_the_gap_per_position():
    """64 of 4,096: 6 low bits each and a 128-bit bitmap, 64 bytes (12 bits each take 96);
    410 of 4,096: 3 low bits each (154 bytes) and a 922-bit bitmap (116), 270 bytes (615)."""
    assert elias_fano.row_bytes(64, 4096) == 64
    assert elias_fano.row_bytes(410, 4096) == 270


def test_a_bitmap_naming_another_count_of_positions_is_refused():
    packed = elias_fano.encode(torch.tensor([[1, 5, 9, 30]]), 64)
    packed[0, -1] |= 0x80  # one more bit set in the bitmap's last byte
    with pytest.raises(ValueError, match="name other than its 4 positions"):
        elias_fano.decode(packed, 4, 64)


def test_the_default_sends_at_most_a_fiftieth_of_fp32():
    """8% of each 4,096 at 2 bits: 318 bytes a chunk (8 of levels, 228 of positions, 82 of
    values), header and prefix included 1/51 of fp32 for a million values; SparseLoCo's 64 of
    4,096 take 88 bytes a chunk, 1/184."""
    tensor = sample_tensor("gaussian", 1 << 20)
    fp32 = len(wire.encode(tensor, make_codec("fp32"), META))
    default = len(wire.encode(tensor, make_codec("sparse"), META)) / fp32
    assert default > 1 / 52
    assert default < 1 / 50
    assert len(wire.encode(tensor, make_codec("sparse", k=64), META)) / fp32 < 1 / 184


@pytest.mark.parametrize("numel", [1, 63, 4096, 4096 * 3 + 100])
def test_each_chunk_keeps_its_k_largest_magnitudes_with_their_signs(numel):
    """Chunks of 4,096, the last one short: each keeps min(k, its length) values, exactly
    its largest by magnitude, each with its own sign; every other value decodes to 0."""
    codec = make_codec("sparse", chunk=4096, k=64, bits=3)
    tensor = sample_tensor("student_t", numel, seed=numel)
    decoded = round_trip(tensor, codec)
    for start in range(0, numel, 4096):
        chunk, kept = tensor[start : start + 4096], decoded[start : start + 4096]
        largest = torch.topk(chunk.abs(), min(64, chunk.numel())).indices
        assert set(kept.nonzero().view(-1).tolist()) == set(largest.tolist())
        assert torch.equal(kept[largest].sign(), chunk[largest].sign())


@pytest.mark.parametrize(("kind", "bound"), [("gaussian", 0.07), ("student_t", 0.25)])
def test_kept_values_are_within_the_codebooks_error_and_more_bits_halve_it(kind, bound):
    """2 bits of each of the 64 kept values of 4,096 (a sign and one of 2 levels fitted to the
    chunk) leave under 7% relative error on the kept Gaussian values, 25% on Student-t(3);
    each bit more roughly halves it."""
    tensor = sample_tensor(kind, 1 << 16)
    errors = []
    for bits in (2, 3, 4):
        decoded = round_trip(tensor, make_codec("sparse", k=64, bits=bits))
        kept = decoded != 0
        errors.append(float((decoded[kept] - tensor[kept]).norm() / tensor[kept].norm()))
    assert errors[0] < bound
    assert errors[1] < 0.75 * errors[0]
    assert errors[2] < 0.75 * errors[1]


def test_one_bit_sends_each_kept_value_as_its_sign_times_the_chunks_mean_magnitude():
    tensor = sample_tensor("gaussian", 4096)
    decoded = round_trip(tensor, make_codec("sparse", bits=1))
    kept = decoded != 0
    mean = tensor[kept].abs().mean()
    assert torch.allclose(decoded[kept], tensor[kept].sign() * mean)


def test_encoding_is_deterministic_to_the_byte():
    """A replica encodes its own parts again rather than keeping them, and error feedback
    encodes what it sent again: both rely on the same bytes every time."""
    tensor = sample_tensor("student_t", 5 * 4096 + 7)
    codec = make_codec("sparse", bits=4, k=100)
    assert bytes(wire.encode(tensor, codec, META)) == bytes(wire.encode(tensor, codec, META))


def test_codec_parameters_are_validated():
    with pytest.raises(ValueError, match="multiple of 64"):
        make_codec("sparse", chunk=100)
    with pytest.raises(ValueError, match=r"k \(65\) must be at most chunk"):
        make_codec("sparse", chunk=64, k=65)
    with pytest.raises(ValueError, match="bits"):
        make_codec("sparse", bits=5)


def test_a_sparse_rounds_reduced_shards_are_int8():
    assert reduced_codec(make_codec("sparse")) == Int8Codec(block=64)
    assert reduced_codec(make_codec("int8", block=128)) == Int8Codec(block=128)


# -- every read checked -------------------------------------------------------------------

CODEC = SparseCodec(chunk=64, k=4, bits=2)


def sparse_object(numel: int, levels: list, positions: list, codes: list) -> bytes:
    """A well-checksummed sparse object with any levels, positions and codes (one row of
    each per chunk: 64 values, then the short last one), to reach the checks behind the
    checksum. Positions in Elias-Fano form, however they are ordered."""
    lengths = [min(64, numel - start) for start in range(0, numel, 64)]
    position_rows = [
        elias_fano.encode(torch.tensor([row]), length).numpy().tobytes()
        for row, length in zip(positions, lengths, strict=False)
    ]
    code_rows = [bitpack.pack(torch.tensor([row]), CODEC.bits).numpy().tobytes() for row in codes]
    level_bytes = torch.tensor(levels, dtype=torch.float32).numpy().tobytes()
    payload = level_bytes + b"".join(position_rows) + b"".join(code_rows)
    return craft(header_of(META, numel, CODEC.model_dump()), payload)


def test_a_crafted_object_decodes_to_its_values():
    """Chunk 0 keeps 4 of 64 (levels 1 and 2), the short chunk 1 keeps its 6 values' 4 first
    ones (k = 4), with codes naming a level and, in the top bit, the sign."""
    levels, positions = [[1.0, 2.0], [0.5, 3.0]], [[0, 5, 9, 63], [0, 1, 2, 5]]
    decoded = wire.decode(sparse_object(70, levels, positions, [[0, 1, 2, 3], [3, 0, 1, 2]]))
    kept = [0, 5, 9, 63, 64, 65, 66, 69]
    assert decoded.tensor[kept].tolist() == [1.0, 2.0, -1.0, -2.0, -3.0, 0.5, 3.0, -0.5]
    assert int((decoded.tensor != 0).sum()) == 8


@pytest.mark.parametrize(
    ("positions", "levels", "problem"),
    [
        ([[0, 5, 5, 63], [0, 1, 2, 5]], [[1.0, 2.0]] * 2, "strictly ascending within each chunk"),
        ([[9, 5, 10, 63], [0, 1, 2, 5]], [[1.0, 2.0]] * 2, "strictly ascending within each chunk"),
        ([[0, 5, 9, 63], [0, 1, 2, 6]], [[1.0, 2.0]] * 2, "beyond its chunk of 6 values"),
        (
            [[0, 5, 9, 63], [0, 1, 2, 5]],
            [[1.0, float("nan")], [1.0, 2.0]],
            "sparse levels has 1 non",
        ),
        ([[0, 5, 9, 63], [0, 1, 2, 5]], [[1.0, 2.0], [-1.0, 2.0]], "levels must be >= 0"),
    ],
)
def test_bad_positions_and_levels_are_refused_naming_the_key(positions, levels, problem):
    data = sparse_object(70, levels, positions, [[0, 1, 2, 3], [3, 0, 1, 2]])
    with pytest.raises(framing.WireFormatError) as refused:
        wire.decode(data, key=KEY)
    assert refused.value.key == KEY
    assert problem in refused.value.problem


def test_a_payload_of_another_size_than_the_header_implies_is_refused():
    data = sparse_object(
        70, [[1.0, 2.0], [0.5, 3.0]], [[0, 5, 9, 63]], [[0, 1, 2, 3], [3, 0, 1, 2]]
    )
    with pytest.raises(framing.WireFormatError, match="codec sparse with shape \\[70\\] needs"):
        wire.decode(data, key=KEY)
