"""Every record and wire object a replica reads comes from a bucket anyone with write access
could have written: arbitrary bytes, or a valid object with a field changed (checksum made
right again, so the bytes reach validation), give the reader's own error naming the key, or
a valid result; never another exception. Fast by design (small objects, few hundred cases)."""

from __future__ import annotations

import json
from collections.abc import Callable

import crc32c
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco_anywhere.bucket import wire
from diloco_anywhere.bucket.codec import make_codec
from diloco_anywhere.bucket.record import RECORD_MAGIC, decode_record, encode_record
from diloco_anywhere.collective.membership import Claim, Lease
from diloco_anywhere.collective.records import Manifest, PartEntry, Seal, ShardFailure
from diloco_anywhere.training.checkpoint import CheckpointCommit, StoredObject
from diloco_anywhere.training.metrics import EventLine, MetricsChunk, StepLine, SyncLine

KEY = "run/rounds/0000000001/0/SEAL"
PART = PartEntry(key="run/rounds/0000000001/0/parts/a-0/0", size=300, crc32c=7, start=0, stop=64)
SAMPLES = [
    Seal(run="run", round=1, fragment=0, contributors=("a-0", "b-1"), mode="sharded",
         sealed_by="a-0", claims={"a": 0, "b": 1}),
    Manifest(run="run", round=1, fragment=0, replica="a", incarnation=0, weight=2.0,
             fingerprint="f", codec=make_codec("int8"), numel=64, parts=(PART,)),
    ShardFailure(run="run", round=1, fragment=0, shard=3, key=PART.key, problem="checksum"),
    Claim(replica="a", incarnation=2, nonce="n", started_at=1.5),
    Lease(replica="a", incarnation=2, beat=9, written_at=3.5, skew=-0.25,
          finished={"0": 4, "1": 3}),
    MetricsChunk(run="run", replica="a", incarnation=0, platform="local", seq=1, lines=(
        StepLine(step=1, loss=2.5, tokens=10, time=1.0),
        SyncLine(outer_step=1, committed=True, participants=2, eval_loss=None, tokens=10,
                 tokens_per_second=1.0, sync_exposed_seconds=0.1, bytes_up=1, bytes_down=2,
                 time=2.0),
        EventLine(event="started", time=0.0),
    )),
    CheckpointCommit(run="run", round=3, step=3, sync=4, fingerprint="step-3-0000abcd",
                     state=StoredObject(key="run/checkpoints/3/state", size=10, crc32c=1),
                     shards=(StoredObject(key="run/checkpoints/3/shard-0", size=10, crc32c=2),)),
]  # fmt: skip
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
    | st.text(max_size=8) | st.sampled_from(["\u00b2", "-1", "1e309", "a-\u0661"]),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)  # fmt: skip


def _record_bytes(body: bytes) -> bytes:
    """A record whose checksum is right for ``body``: it reaches the model's validation."""
    prefix = wire.PREFIX.pack(RECORD_MAGIC, wire.VERSION, bytes(3), len(body), crc32c.crc32c(body))
    return prefix + body


def _outcome(read: Callable[[], object]) -> object:
    """What ``read`` returned, or the ``WireFormatError`` it raised (anything else fails)."""
    try:
        return read()
    except wire.WireFormatError as exc:
        return exc


def _refused_here(outcome: object) -> bool:
    return isinstance(outcome, wire.WireFormatError) and outcome.key == KEY


def _read_or_refuse(data: bytes, model: type) -> None:
    outcome = _outcome(lambda: decode_record(data, model, key=KEY))
    assert _refused_here(outcome) or isinstance(outcome, model), outcome


@settings(max_examples=150, deadline=None)
@given(sample=st.sampled_from(SAMPLES), data=st.binary(max_size=300))
def test_arbitrary_bytes_at_a_record_key(sample, data):
    _read_or_refuse(data, type(sample))


@settings(max_examples=300, deadline=None)
@given(sample=st.sampled_from(SAMPLES), data=st.data())
def test_a_record_with_a_field_changed(sample, data):
    body = json.loads(encode_record(sample)[wire.PREFIX.size :])
    field = data.draw(st.sampled_from(sorted(body)))
    body[field] = data.draw(JSON_VALUES)
    _read_or_refuse(_record_bytes(json.dumps(body).encode()), type(sample))


@settings(max_examples=200, deadline=None)
@given(sample=st.sampled_from(SAMPLES), data=st.data())
def test_a_record_with_bytes_changed_and_its_checksum_made_right(sample, data):
    body = bytearray(encode_record(sample)[wire.PREFIX.size :])
    for _ in range(data.draw(st.integers(1, 4))):
        body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    _read_or_refuse(_record_bytes(bytes(body)), type(sample))


META = wire.ObjectMeta(run="run", round=1, replica="a", incarnation=0, shard=0)


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8"])
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_a_wire_object_with_bytes_changed_is_refused_or_exact(codec, data):
    """Any byte of a part changed: the checksum, the header or the codec's checks refuse it
    (naming the key), or the change was a no-op."""
    encoded = bytearray(wire.encode(torch.linspace(-3, 3, 64), make_codec(codec), META))
    original = wire.decode(bytes(encoded))
    encoded[data.draw(st.integers(0, len(encoded) - 1))] ^= data.draw(st.integers(1, 255))
    outcome = _outcome(lambda: wire.decode(bytes(encoded), key=KEY))
    assert _refused_here(outcome) or torch.equal(outcome.tensor, original.tensor), outcome


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=400))
def test_arbitrary_bytes_at_a_part_key(data):
    outcome = _outcome(lambda: wire.decode(data, key=KEY))
    assert _refused_here(outcome) or isinstance(outcome, wire.Decoded), outcome
