"""Readers reading through a store, as a replica or `diloco status` does: an object far larger
than its reader accepts is refused after at most one byte past that size (never downloaded
whole), and whatever bytes sit at a published config, a checkpoint's objects or a metrics
chunk give that reader's own error naming the key, or a valid result."""

from __future__ import annotations

import functools
import logging
import threading
import uuid
from collections.abc import Callable, Iterator

import crc32c
import pytest
import tomli_w
import tomllib
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco_anywhere.bucket.codecs.codec import make_codec
from diloco_anywhere.bucket.format import framing
from diloco_anywhere.bucket.format.layout import Participant, RunLayout
from diloco_anywhere.bucket.format.record import (
    RECORD_MAGIC,
    RECORD_READ_LIMIT,
    decode_record,
    encode_record,
)
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.allreduce import finish_round
from diloco_anywhere.collective.errors import SealedContributionError
from diloco_anywhere.collective.members.membership import MembershipView, member_progress
from diloco_anywhere.collective.policy import RoundPolicy
from diloco_anywhere.collective.round import Round
from diloco_anywhere.config import ConfigError, RunConfig, load_config
from diloco_anywhere.published_config import MAX_CONFIG_BYTES, config_text, read_config
from diloco_anywhere.training.checkpoints.reader import load_checkpoint
from diloco_anywhere.training.checkpoints.records import (
    Checkpoint,
    CheckpointCommit,
    CheckpointError,
)
from diloco_anywhere.training.checkpoints.writer import CheckpointPolicy, CheckpointWriter
from diloco_anywhere.training.records.metrics import MetricsReader, MetricsWriter, StepLine

RUN = RunLayout("run")
HUGE = 3 * RECORD_READ_LIMIT  # an object three times the largest record
A, B = Participant("a", 0), Participant("b", 0)


@pytest.fixture
def store() -> Iterator[Store]:
    with Store(f"memory://readers-{uuid.uuid4().hex[:12]}") as store:
        yield store


def _plant_huge(store: Store, key: str) -> None:
    """A record's valid prefix (a 2-byte body), then far more bytes than any record has."""
    body = b"{}"
    prefix = framing.PREFIX.pack(
        RECORD_MAGIC, framing.VERSION, bytes(3), len(body), crc32c.crc32c(body)
    )
    store.delete(key)
    store.put(key, prefix + body + bytes(HUGE))


def _downloaded(store: Store, read: Callable[[], object]) -> tuple[object, int]:
    """What ``read`` returned or raised, and how many bytes it fetched from ``store``."""
    before = store.stats().bytes_down
    try:
        outcome = read()
    except Exception as exc:
        outcome = exc
    return outcome, store.stats().bytes_down - before


def _round(store: Store, me: Participant, members=(A, B), **policy) -> Round:
    policy = RoundPolicy(**{"grace": 0.2, "timeout": 30.0, "part_elements": 256, **policy})
    return Round(store, RUN, 0, 0, me, list(members), policy)


def _contribute(round_: Round, seed: int) -> torch.Tensor:
    tensor = torch.randn(1024, generator=torch.Generator().manual_seed(seed))
    round_.contribute(tensor, 1.0, make_codec("fp32"))
    return tensor


def test_an_oversized_seal_is_refused_after_one_record(store):
    _plant_huge(store, RUN.seal(0, 0))
    outcome, fetched = _downloaded(store, _round(store, A).read_seal)
    assert isinstance(outcome, framing.WireFormatError)
    assert outcome.key == RUN.seal(0, 0)
    assert "larger than a record may be" in str(outcome)
    assert fetched == RECORD_READ_LIMIT


@pytest.mark.parametrize("where", ["manifest", "part"])
def test_an_oversized_contribution_is_excluded_after_one_record_or_part(store, where):
    """b's manifest, or a part its valid manifest names: a excludes b before sealing,
    naming the key, having read no more than one byte past the size it accepts there."""
    _contribute(_round(store, B), seed=1)
    bad = RUN.manifest(0, 0, "b", 0) if where == "manifest" else RUN.part(0, 0, "b", 0, 1)
    _plant_huge(store, bad)
    mine = _round(store, A, mode="gather")
    _contribute(mine, seed=0)
    outcome, fetched = _downloaded(store, lambda: finish_round(mine))
    assert outcome.seal.contributors == ("a-0",)
    assert outcome.excluded["b-0"].startswith(f"{bad}: ")
    assert fetched <= RECORD_READ_LIMIT + (64 << 10)


def test_an_oversized_reduced_shard_fails_the_round_naming_it(store):
    """Sharded: shard 1 is b's to reduce; an object planted at its key stops b's publish and
    is refused by a after one byte past the largest reduced shard."""
    bad = RUN.reduced(0, 0, 1)
    _plant_huge(store, bad)
    _contribute(_round(store, B, mode="sharded", part_elements=512), seed=1)
    with Store(store.url) as own:  # the same bucket; a's reads counted alone
        mine = _round(own, A, mode="sharded", part_elements=512)
        _contribute(mine, seed=0)
        outcome, fetched = _downloaded(own, lambda: finish_round(mine))
    assert isinstance(outcome, SealedContributionError)
    assert bad in str(outcome)
    assert fetched < RECORD_READ_LIMIT + (64 << 10)


def test_an_oversized_lease_costs_its_member_progress_only(store, caplog):
    _plant_huge(store, RUN.lease("a", 0, 0))
    view = MembershipView.read(store, RUN)
    with caplog.at_level(logging.WARNING):
        outcome, fetched = _downloaded(store, lambda: member_progress(store, RUN, view, [A]))
    assert outcome == {"a-0": {}}
    assert "larger than a record may be" in caplog.text
    assert fetched == RECORD_READ_LIMIT


def test_an_oversized_metrics_chunk_is_skipped(store, caplog):
    MetricsWriter(store, RUN, "a", 0, "local").event("started")
    _plant_huge(store, RUN.metrics_chunk("b", 0, 0))
    with caplog.at_level(logging.WARNING):
        outcome, fetched = _downloaded(store, MetricsReader(store, RUN).read)
    assert list(outcome) == ["a"]
    assert f"{RUN.metrics_chunk('b', 0, 0)}: object is larger" in caplog.text
    assert fetched < 2 * RECORD_READ_LIMIT


def test_an_oversized_commit_is_no_checkpoint(store):
    _plant_huge(store, RUN.checkpoint_commit(4))
    outcome, fetched = _downloaded(store, lambda: load_checkpoint(store, RUN, 4))
    assert isinstance(outcome, CheckpointError)
    assert RUN.checkpoint_commit(4) in str(outcome)
    assert fetched == RECORD_READ_LIMIT


def test_an_oversized_published_config_is_refused_after_its_cap(store):
    data = bytes(HUGE)
    key = f"run/configs/{crc32c.crc32c(data):08x}.toml"
    store.put(key, data)
    outcome, fetched = _downloaded(store, lambda: read_config(store, key))
    assert isinstance(outcome, ConfigError)
    assert key in str(outcome)
    assert fetched == MAX_CONFIG_BYTES + 1


# -- whatever bytes sit at a published config, a checkpoint's objects, a metrics chunk -------


def _config_key(data: bytes) -> str:
    """The key a launcher would publish ``data`` under: the CRC check passes, the parse runs."""
    return f"run/configs/{crc32c.crc32c(data):08x}.toml"


def _read_config_or_refuse(data: bytes) -> None:
    with Store(f"memory://config-{uuid.uuid4().hex[:12]}") as store:
        key = _config_key(data)
        store.put(key, data)
        outcome, _ = _downloaded(store, lambda: read_config(store, key))
    refused = isinstance(outcome, ConfigError) and key in str(outcome)
    assert refused or isinstance(outcome, RunConfig), outcome


@settings(max_examples=100)
@given(data=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_arbitrary_bytes_as_a_published_config(data):
    _read_config_or_refuse(data)


TOML_VALUES = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=8) | st.lists(st.integers(-3, 3), max_size=3)
    | st.dictionaries(st.text(max_size=4), st.integers(), max_size=2)
)  # fmt: skip


@settings(max_examples=150)
@given(data=st.data())
def test_a_published_config_with_a_field_changed(data):
    published = tomllib.loads(config_text(load_config()).decode())
    table = data.draw(st.sampled_from(sorted(published)))
    field = data.draw(st.sampled_from(sorted(published[table]) or ["new"]))
    value = data.draw(TOML_VALUES)
    if value is None:
        published[table].pop(field, None)
    else:
        published[table][field] = value
    _read_config_or_refuse(tomli_w.dumps(published).encode())


@functools.cache
def _committed_checkpoint() -> dict[str, bytes]:
    """A real checkpoint's objects (written once): two writers, a model and its optimizer."""
    model = torch.nn.Linear(8, 4)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9)
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    outer.step()
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    tree = {
        "manager": {"step": 4, "batches_committed": 12, "sync": 5},
        "fragments": {
            "F_0": {"original_parameters": weights, "outer_optimizer": outer.state_dict()}
        },
    }
    with Store(f"memory://checkpoint-{uuid.uuid4().hex[:12]}") as store:
        writers = [
            CheckpointWriter(store, RUN, name, CheckpointPolicy.of(RunConfig(), poll=0.01))
            for name in ("a-0", "b-0")
        ]
        threads = [
            threading.Thread(target=w.write, args=(4, ("a-0", "b-0"), tree), kwargs={"last": True})
            for w in writers
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for writer in writers:
            writer.close()
        return {key: store.get(key) for key in store.list_prefix(RUN.checkpoint(4))}


def _with_commit_fixed(objects: dict[str, bytes], changed: str) -> dict[str, bytes]:
    """The COMMIT made to agree with ``changed``'s new bytes (size and CRC32C), so that
    the change reaches the reader's parse instead of stopping at the checksum."""
    key = RUN.checkpoint_commit(4)
    commit = decode_record(objects[key], CheckpointCommit, key=key)
    entries = [commit.state, *commit.shards]
    fixed = [
        e.model_copy(
            update={"size": len(objects[changed]), "crc32c": crc32c.crc32c(objects[changed])}
        )
        if e.key == changed
        else e
        for e in entries
    ]
    commit = commit.model_copy(update={"state": fixed[0], "shards": tuple(fixed[1:])})
    return {**objects, key: encode_record(commit)}


@settings(max_examples=120)
@given(data=st.data())
def test_a_checkpoint_with_an_object_changed_loads_or_is_refused_naming_a_key(data):
    objects = dict(_committed_checkpoint())
    key = data.draw(st.sampled_from(sorted(objects)))
    original = objects[key]
    if data.draw(st.booleans()):
        changed = bytearray(original)
        for _ in range(data.draw(st.integers(1, 4))):
            changed[data.draw(st.integers(0, len(changed) - 1))] = data.draw(st.integers(0, 255))
        objects[key] = bytes(changed)
    else:
        objects[key] = data.draw(st.binary(max_size=200))
    if key != RUN.checkpoint_commit(4) and data.draw(st.booleans()):
        objects = _with_commit_fixed(objects, key)
    with Store(f"memory://checkpoint-{uuid.uuid4().hex[:12]}") as store:
        for name, value in objects.items():
            store.put(name, value)
        outcome, _ = _downloaded(store, lambda: load_checkpoint(store, RUN, 4))
    refused = isinstance(outcome, CheckpointError) and any(k in str(outcome) for k in objects)
    assert refused or isinstance(outcome, Checkpoint), outcome


@settings(max_examples=100)
@given(data=st.binary(max_size=300))
def test_arbitrary_bytes_at_a_metrics_chunk_cost_that_chunk_only(data):
    with Store(f"memory://metrics-{uuid.uuid4().hex[:12]}") as store:
        writer = MetricsWriter(store, RUN, "a", 0, "local")
        writer.add(StepLine(step=1, loss=float("nan"), tokens=10, time=1.0))
        writer.flush()
        store.put(RUN.metrics_chunk("b", 0, 0), data)
        replicas = MetricsReader(store, RUN).read()
        assert replicas["a"].steps[0].step == 1
        assert set(replicas) <= {"a", "b"}
