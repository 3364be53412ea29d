"""Every record and wire object a replica reads comes from a bucket anyone with write access
could have written: arbitrary bytes, or a valid object with a field changed (checksum made
right again, so the bytes reach validation), give the reader's own error naming the key, or
a valid result; never another exception. Fast by design (small objects, few hundred cases)."""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco_anywhere.bucket.codecs.codec import make_codec
from diloco_anywhere.bucket.format import framing, wire
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.format.record import decode_record, encode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.members.membership import Claim, Lease
from diloco_anywhere.collective.records import Manifest, PartEntry, Seal, ShardFailure
from diloco_anywhere.config import RunConfig
from diloco_anywhere.training.checkpoints.reader import load_checkpoint
from diloco_anywhere.training.checkpoints.records import (
    Checkpoint,
    CheckpointCommit,
    CheckpointError,
    StoredObject,
)
from diloco_anywhere.training.checkpoints.writer import CheckpointPolicy, CheckpointWriter
from diloco_anywhere.training.records.metrics import EventLine, MetricsChunk, StepLine, SyncLine
from support.checkpoints import counters_after, diloco_like_state, record_bytes, rewrite_counters
from support.wire import craft_raw

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


def _outcome(read: Callable[[], object]) -> object:
    """What ``read`` returned, or the ``WireFormatError`` it raised (anything else fails)."""
    try:
        return read()
    except framing.WireFormatError as exc:
        return exc


def _refused_here(outcome: object) -> bool:
    return isinstance(outcome, framing.WireFormatError) and outcome.key == KEY


def _read_or_refuse(data: bytes, model: type) -> None:
    outcome = _outcome(lambda: decode_record(data, model, key=KEY))
    assert _refused_here(outcome) or isinstance(outcome, model), outcome


@settings(max_examples=150)
@given(sample=st.sampled_from(SAMPLES), data=st.binary(max_size=300))
def test_arbitrary_bytes_at_a_record_key(sample, data):
    _read_or_refuse(data, type(sample))


@settings(max_examples=300)
@given(sample=st.sampled_from(SAMPLES), data=st.data())
def test_a_record_with_a_field_changed(sample, data):
    body = json.loads(encode_record(sample)[framing.PREFIX.size :])
    field = data.draw(st.sampled_from(sorted(body)))
    body[field] = data.draw(JSON_VALUES)
    _read_or_refuse(record_bytes(json.dumps(body).encode()), type(sample))


@settings(max_examples=200)
@given(sample=st.sampled_from(SAMPLES), data=st.data())
def test_a_record_with_bytes_changed_and_its_checksum_made_right(sample, data):
    body = bytearray(encode_record(sample)[framing.PREFIX.size :])
    for _ in range(data.draw(st.integers(1, 4))):
        body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    _read_or_refuse(record_bytes(bytes(body)), type(sample))


META = wire.ObjectMeta(run="run", round=1, replica="a", incarnation=0, shard=0)


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "sparse"])
@settings(max_examples=100)
@given(data=st.data())
def test_a_wire_object_with_bytes_changed_is_refused_or_exact(codec, data):
    """Any byte of a part changed: the checksum, the header or the codec's checks refuse it
    (naming the key), or the change was a no-op."""
    encoded = bytearray(wire.encode(torch.linspace(-3, 3, 64), make_codec(codec), META))
    original = wire.decode(bytes(encoded))
    encoded[data.draw(st.integers(0, len(encoded) - 1))] ^= data.draw(st.integers(1, 255))
    outcome = _outcome(lambda: wire.decode(bytes(encoded), key=KEY))
    assert _refused_here(outcome) or torch.equal(outcome.tensor, original.tensor), outcome


SPARSE = make_codec("sparse", chunk=64, k=8, bits=3)


@settings(max_examples=300)
@given(data=st.data())
def test_a_sparse_object_with_payload_bytes_changed_and_its_checksum_made_right(data):
    """Past the checksum, the sparse codec's own checks: an object refused naming its key, or
    finite values with at most k kept per chunk of 64 (positions in range, none twice)."""
    encoded = bytearray(wire.encode(torch.linspace(-3, 3, 150), SPARSE, META))
    header_length = framing.PREFIX.unpack_from(encoded)[3]
    payload_at = framing.PREFIX.size + header_length
    for _ in range(data.draw(st.integers(1, 4))):
        offset = data.draw(st.integers(payload_at, len(encoded) - 1))
        encoded[offset] = data.draw(st.integers(0, 255))
    changed = craft_raw(bytes(encoded[framing.PREFIX.size : payload_at]), encoded[payload_at:])
    outcome = _outcome(lambda: wire.decode(changed, key=KEY))
    if _refused_here(outcome):
        return
    assert isinstance(outcome, wire.Decoded), outcome
    assert bool(torch.isfinite(outcome.tensor).all())
    kept = (outcome.tensor != 0).view(-1)
    assert all(int(kept[start : start + 64].sum()) <= 8 for start in range(0, 150, 64))


@settings(max_examples=150)
@given(data=st.binary(max_size=400))
def test_arbitrary_bytes_at_a_part_key(data):
    outcome = _outcome(lambda: wire.decode(data, key=KEY))
    assert _refused_here(outcome) or isinstance(outcome, wire.Decoded), outcome


# -- a checkpoint's values: every one untrusted -----------------------------------------------

CHECKPOINT_RUN = RunLayout("run")


def _checkpoint_objects(tree: dict, round_: int = 6) -> dict[str, bytes]:
    """The objects of ``tree``'s checkpoint of ``round_``, as the real writer commits them."""
    with Store(f"memory://fuzz-{uuid.uuid4().hex[:12]}") as store:
        writer = CheckpointWriter(store, CHECKPOINT_RUN, "a-0", CheckpointPolicy.of(RunConfig()))
        writer.write(round_, ("a-0",), tree | {"manager": counters_after(round_)}, last=True)
        writer.close()
        return {key: store.get(key) for key in store.list_prefix(CHECKPOINT_RUN.checkpoints())}


def _load_changed(objects: dict[str, bytes], change: Callable[[Store], None]) -> object:
    """Round 6's checkpoint of ``objects`` once ``change`` has rewritten it: what loading it
    returns, or the ``CheckpointError`` it raises (anything else fails)."""
    with Store(f"memory://fuzz-{uuid.uuid4().hex[:12]}") as store:
        store.put_many(objects)
        change(store)
        try:
            return load_checkpoint(store, CHECKPOINT_RUN, 6)
        except CheckpointError as exc:
            return exc


def _refused_naming_a_key(outcome: object) -> bool:
    prefix = f"{CHECKPOINT_RUN.checkpoint(6)}/"
    return isinstance(outcome, CheckpointError) and str(outcome).startswith(prefix)


COUNTER_VALUES = JSON_VALUES | st.integers(-3, 10) | st.sampled_from([10**10, 2**63, 2**64])


@settings(max_examples=100)
@given(data=st.data())
def test_a_checkpoint_with_counters_changed_holds_a_managers_counters_or_is_refused(data):
    """Counters the state and its COMMIT agree on (checksums and fingerprint made right): the
    checkpoint loads only with counters a manager can hold, which healing can replay from."""
    names = data.draw(st.lists(st.sampled_from(["step", "sync", "batches_committed"]), min_size=1))
    counters = {name: data.draw(COUNTER_VALUES) for name in names}
    objects = _checkpoint_objects(diloco_like_state())
    outcome = _load_changed(
        objects, lambda store: rewrite_counters(store, CHECKPOINT_RUN, 6, **counters)
    )
    if _refused_naming_a_key(outcome):
        return
    held = outcome.tree["manager"]
    assert all(type(value) is int for value in held.values()), held
    assert held["sync"] == 7, held
    assert held["step"] <= held["sync"], held
    assert held["step"] <= held["batches_committed"] <= 2**63 - 1, held


FLOATS = st.floats(width=32) | st.sampled_from([math.nan, math.inf, -math.inf])


@settings(max_examples=60)
@given(values=st.lists(FLOATS, min_size=4, max_size=4))
def test_a_checkpoint_with_weights_of_any_value_loads_them_finite_or_is_refused(values):
    """Whatever values the writer was given (its checksums and fingerprint agree with them),
    a reader loads only finite ones."""
    tree = diloco_like_state()
    tree["fragments"]["StreamingDiLoCoFragment_0"]["original_parameters"]["1.bias"] = torch.tensor(
        values, dtype=torch.float32
    )
    outcome = _load_changed(_checkpoint_objects(tree), lambda store: None)
    if all(math.isfinite(value) for value in values):
        assert isinstance(outcome, Checkpoint), outcome
    else:
        assert _refused_naming_a_key(outcome), outcome
