"""The sync path streams: bounded windows of parts, no whole copies, results written in place."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco_anywhere.bench.store import sample_tensor
from diloco_anywhere.bucket.codecs.codec import make_codec
from diloco_anywhere.bucket.errors import StoreError
from diloco_anywhere.bucket.format import framing, wire
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.allreduce import BucketCollective
from diloco_anywhere.collective.exchanges.sharded import _ShardedExchange
from diloco_anywhere.collective.flat import FlatTensors
from diloco_anywhere.collective.mean import weighted_mean
from diloco_anywhere.collective.parts import PartIO, Transfers
from diloco_anywhere.collective.policy import CollectiveConfig, RoundPolicy
from diloco_anywhere.collective.records import MAX_WEIGHT, Manifest, check_weight
from diloco_anywhere.collective.transfers import AdaptiveWindow, windowed

META = wire.ObjectMeta(run="run", round=0, replica="a", incarnation=0, shard=0)


def test_a_window_bounds_the_work_in_flight_and_keeps_order():
    running, peak, lock = 0, 0, threading.Lock()

    def work(item: int) -> int:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.01 * (item % 3))  # finishing out of order
        with lock:
            running -= 1
        return item

    with ThreadPoolExecutor(16) as executor:
        assert list(windowed(executor, work, range(40), window=3)) == list(range(40))
    assert peak <= 3


def test_a_consumer_that_stops_early_gets_every_result_released():
    released = []
    with ThreadPoolExecutor(4) as executor:
        results = windowed(executor, lambda item: item, range(10), 4, release=released.append)
        assert next(results) == 0
        results.close()  # e.g. the round failed on the first part
    assert sorted(released) == [1, 2, 3]  # submitted, never consumed: given back


def test_flat_tensors_read_and_write_across_tensors_and_dtypes():
    tensors = [
        torch.arange(3.0),
        torch.arange(3.0, 8.0).to(torch.bfloat16),
        torch.arange(8.0, 10.0),
    ]
    flat = FlatTensors(tensors)
    assert flat.numel == 10
    assert flat.read(0, 3).data_ptr() == tensors[0].data_ptr()  # one float32 tensor: a view
    assert flat.read(2, 9).tolist() == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    flat.write(2, torch.full((7,), -1.0))
    assert [t.tolist() for t in tensors] == [[0.0, 1.0, -1.0], [-1.0] * 5, [-1.0, 9.0]]


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ([torch.ones(2, 3).t()], "needs contiguous tensors"),
        ([torch.ones(2, dtype=torch.int64)], "floating-point tensors"),
        ([], "at least one tensor"),
    ],
)
def test_flat_tensors_refuse_what_cannot_receive_a_mean_in_place(tensors, message):
    with pytest.raises(ValueError, match=message):
        FlatTensors(tensors)


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8"])
def test_a_corrupt_chunk_late_in_an_object_fails_the_read(codec):
    """Values stream out before the checksum is complete; the read still fails at the end."""
    data = bytearray(
        wire.encode(sample_tensor("gaussian", 1 << 20, seed=1), make_codec(codec), META)
    )
    data[-3] ^= 0x10  # in the last chunk
    reader = wire.WireReader(data, key="k")
    with pytest.raises(framing.WireFormatError, match="k: checksum mismatch"):
        for _ in reader.chunks():
            pass


def test_an_own_part_is_read_from_the_bucket_when_the_tensors_changed(caplog):
    """Own parts are encoded again from the caller's tensors; if those changed meanwhile, the
    sealed bytes are read back instead, so what is averaged is what was sealed."""
    store = Store("memory://streaming-own")
    parts = PartIO(store, Transfers.create(window=2))
    tensor = sample_tensor("gaussian", 1000, seed=3)
    sent = tensor.clone()
    source = FlatTensors([tensor])
    entry = parts.upload(source, range(0, 1000), make_codec("fp32"), META, "run/part")
    manifest = Manifest(
        run="run", round=0, fragment=0, replica="a", incarnation=0, weight=1.0,
        fingerprint="", codec=make_codec("fp32"), numel=1000, parts=(entry,),
    )  # fmt: skip
    mine = parts.own(source, "a-0", manifest, 0, META)
    assert mine.trusted
    assert torch.equal(torch.cat([v for _, v in mine.chunks()]), sent)
    mine.release()
    tensor.add_(1.0)  # the caller broke its promise
    read_back = parts.own(source, "a-0", manifest, 0, META)
    assert not read_back.trusted
    assert torch.equal(torch.cat([v for _, v in read_back.chunks()]), sent)
    assert "tensors changed while its round was in flight" in caplog.text


@pytest.mark.parametrize("mode", ["gather", "sharded"])
def test_a_sync_of_many_tensors_of_mixed_dtypes_gets_the_mean_in_place(mode):
    """Parts span tensor boundaries (small parts here); every tensor receives its slice of the
    mean, cast to its own dtype, and no other memory holds the result."""
    store = Store(f"memory://streaming-many-{mode}")
    shapes = [(7, 5), (11,), (3, 4, 2)]
    policy = RoundPolicy(grace=30, timeout=60, mode=mode, part_elements=16, window=3,
                         expected_replicas=2)  # fmt: skip
    config = CollectiveConfig(round=policy)
    inputs = {
        name: [
            sample_tensor("gaussian", torch.Size(shape).numel(), seed=10 * i + k).view(shape)
            for k, shape in enumerate(shapes)
        ]
        for i, name in enumerate(("a", "b"))
    }
    for tensors in inputs.values():
        tensors[1] = tensors[1].to(torch.bfloat16)
    flat = {name: torch.cat([t.float().reshape(-1) for t in ts]) for name, ts in inputs.items()}
    expected = weighted_mean([(flat["a"], 1.0), (flat["b"], 1.0)])
    with (
        BucketCollective(store, "run", "a", config) as a,
        BucketCollective(store, "run", "b", config) as b,
    ):
        works = [c.allreduce(inputs[n], round_=0) for c, n in ((a, "a"), (b, "b"))]
        for work in works:
            work.wait(timeout=60)
    offset = 0
    for k, shape in enumerate(shapes):
        count = torch.Size(shape).numel()
        want = expected[offset : offset + count].view(shape)
        for name in ("a", "b"):
            got = inputs[name][k]
            assert torch.equal(got, want.to(got.dtype)), (name, k)
        offset += count
    assert works[0].result().seal.mode == mode


def test_a_reduction_that_fails_stops_collecting_and_fails_the_round(tmp_path):
    """Each replica collects the others' shards while it reduces its own; when its own
    reduction fails (here: a file where the reduced shards' folder must go, so no reduced
    shard can be put, and reading one finds nothing), collecting stops at once. orphan_grace
    is an hour: a collector left running would wait that long for shards nobody publishes."""
    blocker = tmp_path / RunLayout("run").reduced(0, 0, 0).rsplit("/", 1)[0]
    blocker.parent.mkdir(parents=True)
    blocker.write_bytes(b"")
    store = Store(f"file://{tmp_path}")
    policy = RoundPolicy(grace=30, timeout=3600, mode="sharded", part_elements=8,
                         expected_replicas=2, orphan_grace=3600)  # fmt: skip
    config = CollectiveConfig(round=policy)
    with (
        BucketCollective(store, "run", "a", config) as a,
        BucketCollective(store, "run", "b", config) as b,
    ):
        works = [c.allreduce(torch.ones(64), round_=0) for c in (a, b)]
        for work in works:
            with pytest.raises(StoreError, match="a folder on its path is already a key"):
                work.wait()


def _collector(owners: list[str], window: int) -> _ShardedExchange:
    """Only what choosing the next reads needs: who owns each shard, and the window."""
    exchange = _ShardedExchange.__new__(_ShardedExchange)
    exchange.owners = owners
    exchange.transfers = Transfers(executor=None, pool=None, control=AdaptiveWindow(window))  # type: ignore[arg-type]
    return exchange


def test_collecting_fills_the_window_from_streaming_owners_and_probes_the_others_once():
    exchange = _collector(["a", "b", "c"] * 6, window=4)

    def queues() -> dict[str, list[int]]:  # a's shards are ours
        return {"b": [1, 4, 7, 10, 13, 16], "c": [2, 5, 8, 11, 14, 17]}

    now = time.monotonic()
    # b's shards are arriving, c's probe came back empty and is due again in an hour
    queued = queues()
    chosen = exchange._next_fetches(queued, Counter(), {"b"}, {"b": now, "c": now + 3600})
    assert chosen == [1, 4, 7, 10]
    assert queued == {"b": [13, 16], "c": [2, 5, 8, 11, 14, 17]}  # taken off the queues
    # once c's poll is due it is probed at one shard, beside b's stream
    chosen = exchange._next_fetches(queues(), Counter(), {"b"}, {"b": now, "c": now - 1})
    assert chosen == [1, 4, 7, 10, 2]
    # a due probe goes out even when b's reads fill the window
    chosen = exchange._next_fetches(queues(), Counter(b=4), {"b"}, {"b": now, "c": now - 1})
    assert chosen == [2]
    # nobody streams yet: one probe per owner, nothing more
    chosen = exchange._next_fetches(queues(), Counter(), set(), {"b": now - 1, "c": now - 1})
    assert chosen == [1, 2]
    # an owner with a probe in flight is not probed again
    chosen = exchange._next_fetches(queues(), Counter(c=1), set(), {"b": now - 1, "c": now - 1})
    assert chosen == [1]


@settings(max_examples=200)
@given(
    weights=st.lists(st.floats(min_value=2.0**-30, max_value=MAX_WEIGHT), min_size=1, max_size=6),
    data=st.data(),
)
def test_any_accepted_weights_give_a_finite_mean(weights, data):
    """Each contribution is scaled by its share of the total weight, so no weight and no
    finite float32 values can overflow the mean (a weight of 1e19 times 3e38 would)."""
    finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
    contributions = [
        (torch.tensor(data.draw(st.lists(finite32, min_size=3, max_size=3))), weight)
        for weight in weights
    ]
    assert bool(torch.isfinite(weighted_mean(contributions)).all())


@pytest.mark.parametrize("weight", [0.0, -1.0, 1e39, float("inf"), float("nan")])
def test_a_weight_out_of_range_is_refused_where_it_is_set_and_where_it_is_read(weight):
    with pytest.raises(ValueError, match="a number > 0 and at most 2\\^64"):
        check_weight(weight)
    store = Store(f"memory://bad-weight-{weight}")
    with (
        BucketCollective(store, "run", "a") as collective,
        pytest.raises(ValueError, match="a number > 0 and at most 2\\^64"),
    ):
        collective.allreduce(torch.ones(4), round_=0, weight=weight).wait()
