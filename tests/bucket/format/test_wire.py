"""Wire format: round trips for every dtype and codec; every malformed input -> WireFormatError."""

from __future__ import annotations

import os
import pickle
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco_anywhere.bucket.codecs.codec import Bf16Codec, Fp32Codec, Int8Codec, make_codec
from diloco_anywhere.bucket.format import framing, wire
from support.wire import craft, craft_raw, header_of

META = wire.ObjectMeta(run="run-1", round=7, replica="modal-0", incarnation=3, shard=2)
DTYPES = list(wire.DTYPES.values())
CODECS = st.one_of(
    st.just(Fp32Codec()),
    st.just(Bf16Codec()),
    st.sampled_from([8, 16, 64, 128]).map(lambda block: Int8Codec(block=block)),
)
FUZZ = settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def tensors(draw) -> torch.Tensor:
    shape = draw(st.lists(st.integers(0, 40), min_size=0, max_size=3))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31))
    scale = draw(st.sampled_from([1e-6, 1.0, 1e3]))
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * scale).to(dtype)


def max_allowed_error(codec, expected: torch.Tensor) -> torch.Tensor:
    """Per-element error bound of each codec (int8: half a quantization step of its block)."""
    if isinstance(codec, Fp32Codec):
        return torch.zeros_like(expected)
    if isinstance(codec, Bf16Codec):
        return expected.abs() * 2**-8
    flat = expected.reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % codec.block))
    absmax = padded.view(-1, codec.block).abs().amax(dim=1)
    block_absmax = absmax.repeat_interleave(codec.block)[: flat.numel()]
    # half a step, plus float32 rounding: the scale, its inverse, the scaled value and the
    # decoded product each err by up to half an ulp of a value up to absmax (2^-24 of it)
    rounding = 4 * 2**-24 * block_absmax
    return (block_absmax / 127 / 2 + rounding).view(expected.shape)


@FUZZ
@given(tensor=tensors(), codec=CODECS)
def test_round_trip_every_dtype_and_codec(tensor, codec):
    decoded = wire.decode(bytes(wire.encode(tensor, codec, META)), key="k")
    expected = tensor.float()
    assert decoded.tensor.dtype == torch.float32
    assert decoded.tensor.shape == tensor.shape
    assert decoded.header.codec == codec
    assert decoded.header.dtype == str(tensor.dtype).removeprefix("torch.")
    assert decoded.header.model_dump(include=set(wire.ObjectMeta.model_fields)) == META.model_dump()
    error = (decoded.tensor - expected).abs()
    assert bool((error <= max_allowed_error(codec, expected)).all())


@st.composite
def encoded_objects(draw) -> bytearray:
    return wire.encode(draw(tensors()), draw(CODECS), META)


def assert_rejected(data, key="rounds/7/modal-0") -> framing.WireFormatError:
    with pytest.raises(framing.WireFormatError) as info:
        wire.decode(data, key=key)
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}: ")
    return info.value


@FUZZ
@given(obj=encoded_objects(), data=st.data())
def test_any_flipped_bit_is_rejected(obj, data):
    bit = data.draw(st.integers(0, len(obj) * 8 - 1))
    obj[bit // 8] ^= 1 << (bit % 8)
    assert_rejected(bytes(obj))


@FUZZ
@given(obj=encoded_objects(), data=st.data())
def test_truncated_or_extended_objects_are_rejected(obj, data):
    cut = data.draw(st.integers(0, len(obj) - 1))
    assert_rejected(bytes(obj[:cut]))
    assert_rejected(bytes(obj) + data.draw(st.binary(min_size=1, max_size=64)))


@FUZZ
@given(junk=st.binary(max_size=512))
def test_arbitrary_bytes_are_rejected(junk):
    assert_rejected(junk)


def test_pickle_payload_is_rejected_and_never_run(tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    for payload in (pickle.dumps(Exploit()), pickle.dumps(torch.zeros(3))):
        error = assert_rejected(payload)
        assert "not a diloco-anywhere wire object" in error.problem
    assert not marker.exists()


def floats(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def good_header(**changes) -> dict:
    return header_of(META, 2, {"name": "fp32"}) | changes


def test_crafted_valid_object_decodes():
    decoded = wire.decode(craft(good_header(), floats(1.0, 2.0)))
    assert decoded.tensor.tolist() == [1.0, 2.0]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dtype": "int64"}, "header field dtype: Input should be 'float32'"),
        ({"codec": {"name": "zstd"}}, "header field codec: Input tag 'zstd'"),
        ({"codec": {"name": "int8", "block": 5}}, "header field codec.int8.block"),
        ({"shape": [-1]}, "header field shape.0: Input should be greater than or equal to 0"),
        ({"shape": [1] * 9}, "header field shape: Tuple should have at most 8 items"),
        ({"round": "7"}, "header field round: Input should be a valid integer"),
        ({"replica": "../etc"}, "header field replica: String should match pattern"),
        ({"extra": 1}, "header field extra: Extra inputs are not permitted"),
    ],
)
def test_bad_header_fields_are_named(changes, message):
    error = assert_rejected(craft(good_header(**changes), bytes(8)))
    assert message in error.problem


def test_missing_header_field_is_named():
    header = good_header()
    del header["run"]
    assert "header field run: Field required" in assert_rejected(craft(header, bytes(8))).problem


@pytest.mark.parametrize("header", [b"{not json", b"\xff\xfe", b"[1, 2]", b""])
def test_header_that_is_not_a_json_object_is_rejected(header):
    problem = assert_rejected(craft_raw(header, bytes(8))).problem
    assert problem.startswith(("header: Invalid JSON", "header: Input should be an object"))


def test_payload_length_must_match_header():
    error = assert_rejected(craft(good_header(shape=[3]), bytes(8)))
    assert "payload is 8 bytes; codec fp32 with shape [3] needs 12" in error.problem


def test_huge_header_length_is_rejected_before_use():
    prefix = framing.PREFIX.pack(framing.MAGIC, framing.VERSION, bytes(3), 2**32 - 1, 0)
    assert "header length 4294967295 exceeds" in assert_rejected(prefix + b"{}").problem


@pytest.mark.parametrize(
    ("codec", "payload", "message"),
    [
        ("fp32", floats(float("nan"), 1.0), "1 non-finite"),
        ("int8", floats(float("inf")) + bytes(2), "int8 scales has 1"),
        ("int8", floats(-1.0) + bytes(2), "scales must be >= 0"),
    ],
)
def test_non_finite_payloads_are_rejected(codec, payload, message):
    params = {"name": "int8", "block": 64} if codec == "int8" else {"name": codec}
    error = assert_rejected(craft(good_header(codec=params), payload))
    assert message in error.problem


def test_unknown_version_and_reserved_bytes_are_rejected():
    obj = wire.encode(torch.ones(3), Fp32Codec(), META)
    assert "format version 2" in assert_rejected(bytes(obj[:4]) + b"\x02" + bytes(obj[5:])).problem
    assert "reserved" in assert_rejected(bytes(obj[:5]) + b"\x01" + bytes(obj[6:])).problem


def test_encode_refuses_what_it_cannot_send():
    with pytest.raises(ValueError, match="2 non-finite"):
        wire.encode(torch.tensor([1.0, float("nan"), float("inf")]), Fp32Codec(), META)
    with pytest.raises(ValueError, match=r"cannot encode dtype torch\.int64; allowed: float32"):
        wire.encode(torch.ones(2, dtype=torch.int64), Fp32Codec(), META)
    with pytest.raises(ValueError, match="at most 8 dims"):
        wire.encode(torch.ones([1] * 9), Fp32Codec(), META)


def test_decode_of_a_writable_buffer_is_zero_copy():
    obj = wire.encode(torch.tensor([1.0, 2.0]), Fp32Codec(), META)
    decoded = wire.decode(obj)
    obj[-4:] = floats(5.0)  # the payload's last float, in place
    assert decoded.tensor.tolist() == [1.0, 5.0]


def test_decode_of_bytes_gives_a_writable_tensor():
    decoded = wire.decode(bytes(wire.encode(torch.ones(4), make_codec("fp32"), META)))
    decoded.tensor.add_(1)
    assert decoded.tensor.tolist() == [2.0] * 4


@FUZZ
@given(
    shape=st.lists(st.integers(0, 2**64), max_size=4),
    codec=st.sampled_from([{"name": "fp32"}, {"name": "bf16"}, {"name": "int8", "block": 8}]),
    payload=st.binary(max_size=96),
)
def test_checksummed_objects_with_any_header_decode_or_raise_the_documented_error(
    shape, codec, payload
):
    """Past the checksum, forged shapes and payloads still yield a tensor or WireFormatError."""
    try:
        decoded = wire.decode(craft(good_header(shape=shape, codec=codec), payload))
    except framing.WireFormatError:
        return
    assert list(decoded.tensor.shape) == shape
    assert bool(torch.isfinite(decoded.tensor).all())


@pytest.mark.parametrize(
    ("header", "payload", "message"),
    [
        (good_header(shape=[2**62, 2**62, 0]), b"", "product of the non-zero sizes"),
        (
            good_header(shape=[8], codec={"name": "int8", "block": 8}),
            floats(3e38) + bytes([127]) * 8,
            "int8 payload (scale x 127 overflows) has 8 non-finite",
        ),
    ],
)
def test_forged_sizes_and_overflowing_scales_are_rejected(header, payload, message):
    assert message in assert_rejected(craft(header, payload)).problem


@pytest.mark.parametrize(
    ("codec", "message"), [(Bf16Codec(), "cast to bf16"), (Int8Codec(block=8), "int8 block range")]
)
def test_encode_refuses_values_beyond_the_codec_range(codec, message):
    with pytest.raises(ValueError, match=message):
        wire.encode(torch.full((8,), torch.finfo(torch.float32).max), codec, META)
