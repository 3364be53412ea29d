"""Checked records and the run's key layout."""

from __future__ import annotations

import pytest
import torch
from crc32c import crc32c
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco_anywhere.bucket.codecs.codec import make_codec
from diloco_anywhere.bucket.format import framing, wire
from diloco_anywhere.bucket.format.layout import (
    RunLayout,
    contributor,
    parse_contributor,
    parse_count,
)
from diloco_anywhere.bucket.format.record import (
    MAX_RECORD_BYTES,
    RECORD_MAGIC,
    Record,
    decode_record,
    encode_record,
)
from diloco_anywhere.bucket.keys import check_key
from diloco_anywhere.collective.records import Manifest, PartEntry


class Sealed(Record):
    contributors: tuple[str, ...]
    weight: float


SEALED = Sealed(contributors=("a-0", "b-2"), weight=1536.0)


def test_record_round_trip():
    assert decode_record(encode_record(SEALED), Sealed, key="k") == SEALED


@settings(max_examples=200)
@given(bit=st.integers(0, len(encode_record(SEALED)) * 8 - 1))
def test_any_flipped_bit_in_a_record_is_rejected(bit):
    data = bytearray(encode_record(SEALED))
    data[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(framing.WireFormatError) as info:
        decode_record(bytes(data), Sealed, key="rounds/1/0/SEAL")
    assert info.value.key == "rounds/1/0/SEAL"


def test_record_of_another_model_names_the_fields():
    class Lease(Record):
        until: float

    with pytest.raises(framing.WireFormatError, match="Lease field until: Field required"):
        decode_record(encode_record(SEALED), Lease, key="k")


def test_wire_object_is_not_a_record_and_vice_versa():
    meta = wire.ObjectMeta(run="r", round=0, replica="a", incarnation=0, shard=0)
    tensor_object = wire.encode(torch.ones(2), make_codec("fp32"), meta)
    with pytest.raises(framing.WireFormatError, match="not a diloco-anywhere record"):
        decode_record(bytes(tensor_object), Sealed, key="k")
    with pytest.raises(framing.WireFormatError, match="not a diloco-anywhere wire object"):
        wire.decode(encode_record(SEALED), key="k")


def craft_record(body: bytes, declared_length: int | None = None) -> bytes:
    """A record whose checksum is right for ``body``, to reach the checks behind it."""
    length = len(body) if declared_length is None else declared_length
    return framing.PREFIX.pack(RECORD_MAGIC, framing.VERSION, bytes(3), length, crc32c(body)) + body


def test_trailing_bytes_after_a_record_are_rejected():
    body = SEALED.model_dump_json().encode()
    with pytest.raises(framing.WireFormatError, match="its prefix says"):
        decode_record(craft_record(body + b"x", len(body)), Sealed, key="k")


def test_strict_types_no_coercion():
    body = b'{"contributors": ["a-0"], "weight": "15"}'
    with pytest.raises(framing.WireFormatError, match="Sealed field weight: Input should be"):
        decode_record(craft_record(body), Sealed, key="k")


LAYOUT = RunLayout("run-1")


def test_layout_keys_are_valid_store_keys_and_rounds_sort_numerically():
    keys = [
        LAYOUT.claim("modal-0", 3),
        LAYOUT.lease("modal-0", 3, 8640),
        LAYOUT.part(12, 0, "modal-0", 3, 7),
        LAYOUT.manifest(12, 0, "modal-0", 3),
        LAYOUT.seal(12, 0),
        LAYOUT.reduced(12, 0, 7),
    ]
    assert [check_key(k) for k in keys] == keys
    assert LAYOUT.seal(12, 1) == "run-1/rounds/0000000012/1/SEAL"
    rounds = [LAYOUT.round(r) for r in (2, 10, 100, 9)]
    assert sorted(rounds) == [LAYOUT.round(r) for r in (2, 9, 10, 100)]


@given(
    replica=st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.=-]{0,20}", fullmatch=True),
    incarnation=st.integers(0, 2**63 - 1),
)
def test_contributor_names_split_back_even_with_dashes(replica, incarnation):
    assert parse_contributor(contributor(replica, incarnation)) == (replica, incarnation)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: RunLayout("../etc"), "run '../etc' is not allowed"),
        (lambda: LAYOUT.claim("a/b", 0), "replica 'a/b' is not allowed"),
        (lambda: LAYOUT.round(-1), "round -1 is not allowed"),
        (lambda: LAYOUT.round(10**10), "an integer from 0 to 9999999999"),
        (lambda: LAYOUT.part(0, 0, "a", 0, True + 0.5), "shard 1.5 is not allowed"),
        (lambda: parse_contributor("nodigits-x"), "is not '<replica>-<incarnation>'"),
    ],
)
def test_bad_layout_inputs_say_what_is_allowed(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(
    "contributors", [(), ("b-0", "a-0"), ("a-0", "a-0"), ("a-0", "../x-0"), ("a-x",)]
)
def test_a_seal_lists_sorted_distinct_contributor_names(contributors):
    """A duplicate would count one contribution twice; a bad name must not reach a key."""
    from diloco_anywhere.collective.records import Seal

    fields = {"run": "run", "round": 0, "fragment": 0, "mode": "gather", "sealed_by": "a-0"}
    with pytest.raises(ValueError, match="contributor"):
        Seal(contributors=contributors, **fields)


def test_a_manifest_of_a_7b_model_in_4_mib_parts_fits_a_record():
    """28 GiB of float32 in 4 MiB parts is 7,168 parts, each named in the manifest."""
    layout, part = RunLayout("run"), 1 << 20
    parts = tuple(
        PartEntry(
            key=layout.part(12345, 0, "replica-7", 3, shard),
            size=4 * part + 200,
            crc32c=2**32 - 1,
            start=shard * part,
            stop=(shard + 1) * part,
        )
        for shard in range(7 * 1024)
    )
    manifest = Manifest(
        run="run", round=12345, fragment=0, replica="replica-7", incarnation=3, weight=1.0,
        fingerprint="f" * 64, codec=make_codec("fp32"), numel=7 * 1024 * part, parts=parts,
    )  # fmt: skip
    assert decode_record(encode_record(manifest), Manifest, key="k") == manifest


def test_a_record_over_the_cap_is_refused_both_ways():
    huge = Sealed(contributors=("x" * 1024,) * (MAX_RECORD_BYTES // 1024), weight=1.0)
    with pytest.raises(ValueError, match=f"Sealed is .* bytes; at most {MAX_RECORD_BYTES}"):
        encode_record(huge)
    body = huge.model_dump_json().encode()
    with pytest.raises(framing.WireFormatError, match="larger than a record may be"):
        decode_record(craft_record(body), Sealed, key="k")
    prefix_only = craft_record(body)[: framing.PREFIX.size]  # the length alone is over the cap
    with pytest.raises(framing.WireFormatError, match=f"the {MAX_RECORD_BYTES}-byte cap"):
        decode_record(prefix_only, Sealed, key="k")


@pytest.mark.parametrize(
    ("text", "value"),
    [("0", 0), ("007", 7), (str(2**63 - 1), 2**63 - 1), (str(2**63), None), ("1" * 20, None),
     ("\u00b2", None), ("\u0661\u0662", None), ("-1", None), ("+1", None), (" 1", None),
     ("1_0", None), ("", None)],
)  # fmt: skip
def test_numbers_in_keys_are_ascii_digits_within_bounds(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("bad", ["\u00b2", "\u0661", str(2**63), "x"])  # ², Arabic-Indic 1
def test_keys_with_numbers_no_writer_makes_are_not_ours(bad):
    """Unicode digits pass ``str.isdigit`` and fail ``int``; every key reader says 'not
    ours' (None) or raises its own ValueError, never another exception."""
    layout = RunLayout("run")
    assert layout.parse_member_key(f"run/members/r/{bad}/claim") is None
    assert layout.parse_member_key(f"run/members/r/0/lease-{bad}") is None
    assert layout.parse_member_key("run/members/r/0/heartbeat") is None  # neither claim nor lease
    assert layout.parse_data_claim(f"run/data/claims/{bad}-0") is None
    assert layout.parse_data_claim("run/data/claims/1-0/extra") is None
    assert layout.parse_data_claim("other/data/claims/1-0") is None
    assert layout.parse_data_claim(layout.data_claim(3, 1)) == (3, 1)
    assert layout.parse_checkpoint_commit(f"run/checkpoints/{bad}/COMMIT") is None
    assert layout.parse_seal(f"run/rounds/{bad}/0/SEAL") is None
    assert layout.parse_seal(f"run/rounds/0000000001/{bad}/SEAL") is None
    assert layout.parse_seal(layout.seal(12, 1)) == 12
    past_the_last_round = str(10**10)  # 11 digits: no key of that round can be built
    assert layout.parse_seal(f"run/rounds/{past_the_last_round}/0/SEAL") is None
    assert layout.parse_checkpoint_commit(f"run/checkpoints/{past_the_last_round}/COMMIT") is None
    assert layout.parse_seal(layout.manifest(12, 1, "r", 0)) is None
    with pytest.raises(ValueError, match="is not '<replica>-<incarnation>'"):
        parse_contributor(f"r-{bad}")
