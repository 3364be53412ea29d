"""Gather-mode rounds across separate OS processes sharing only a store."""

from __future__ import annotations

import multiprocessing
from dataclasses import asdict

import pytest
import torch

from diloco_anywhere import wire
from diloco_anywhere.bench.store import sample_tensor
from diloco_anywhere.codec import make_codec
from diloco_anywhere.collective.gather import (
    GatherRound,
    RoundPolicy,
    RoundTimeoutError,
    weighted_mean,
)
from diloco_anywhere.collective.records import Manifest, PartEntry
from diloco_anywhere.layout import Participant, RunLayout
from diloco_anywhere.record import encode_record
from diloco_anywhere.store import Store

RUN = RunLayout("run")
NUMEL = 10_000
PARTS = 4_096  # several parts per contribution, the last one short


def contribution(index: int) -> torch.Tensor:
    return sample_tensor("student_t", NUMEL, seed=index)


def weight(index: int) -> float:
    return float(100 * (index + 1))  # unequal, e.g. tokens processed


def _replica(url, options, index, members, policy, codec, delay, results):
    import time

    time.sleep(delay)
    store = Store(url, storage_options=options)
    me = Participant(f"r{index}", 0)
    round_ = GatherRound(
        store, RUN, 0, 0, me, [Participant(m, 0) for m in members], RoundPolicy(**policy)
    )
    round_.contribute(contribution(index), weight(index), make_codec(codec))
    try:
        result = round_.result()
        mean = result.mean.numpy().tobytes()
        results.put((me.replica, mean, result.seal.contributors, result.excluded))
    except Exception as exc:
        results.put((me.replica, f"error: {exc!r}", (), {}))


def run_replicas(backend, indices, members, policy, codec="fp32", delays=None):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    delays = delays or {}
    processes = [
        context.Process(
            target=_replica,
            args=(
                backend.url,
                backend.storage_options,
                i,
                members,
                asdict(policy),
                codec,
                delays.get(i, 0.0),
                results,
            ),
        )
        for i in indices
    ]
    for process in processes:
        process.start()
    outcomes = {}
    for _ in processes:
        replica, mean, contributors, excluded = results.get(timeout=120)
        assert not isinstance(mean, str), f"{replica}: {mean}"
        outcomes[replica] = (mean, contributors, excluded)
    for process in processes:
        process.join(timeout=30)
    return outcomes


def reference(indices) -> bytes:
    pairs = [(contribution(i), weight(i)) for i in sorted(indices, key=lambda i: f"r{i}-0")]
    return weighted_mean(pairs).numpy().tobytes()


FAST = RoundPolicy(min_replicas=1, grace=5.0, timeout=60.0, part_elements=PARTS)


@pytest.mark.parametrize(("name", "replicas"), [("path", 2), ("path", 8), ("s3", 3)])
def test_all_replicas_get_identical_bytes_equal_to_the_reference_mean(make_backend, name, replicas):
    indices = range(replicas)
    members = [f"r{i}" for i in indices]
    outcomes = run_replicas(make_backend(name), indices, members, FAST)
    means = {mean for mean, _, _ in outcomes.values()}
    assert means == {reference(indices)}
    assert {contributors for _, contributors, _ in outcomes.values()} == {
        tuple(sorted(f"{m}-0" for m in members))
    }


def test_int8_mean_is_within_the_codec_bound(make_backend):
    outcomes = run_replicas(make_backend("path"), range(3), ["r0", "r1", "r2"], FAST, "int8")
    (mean_bytes,) = {mean for mean, _, _ in outcomes.values()}
    mean = torch.frombuffer(bytearray(mean_bytes), dtype=torch.float32)
    exact = torch.frombuffer(bytearray(reference(range(3))), dtype=torch.float32)
    assert float((mean - exact).norm() / exact.norm()) < 0.02


def test_absent_member_is_sealed_out_after_the_grace_window(make_backend):
    policy = RoundPolicy(min_replicas=2, grace=1.0, timeout=60.0, part_elements=PARTS)
    outcomes = run_replicas(make_backend("path"), [0, 1], ["r0", "r1", "r2"], policy)
    assert {contributors for _, contributors, _ in outcomes.values()} == {("r0-0", "r1-0")}
    assert {mean for mean, _, _ in outcomes.values()} == {reference([0, 1])}


def test_late_replica_is_excluded_but_gets_the_same_result(make_backend):
    policy = RoundPolicy(min_replicas=2, grace=0.5, timeout=60.0, part_elements=PARTS)
    outcomes = run_replicas(
        make_backend("path"), [0, 1, 2], ["r0", "r1", "r2"], policy, delays={2: 6.0}
    )
    assert {contributors for _, contributors, _ in outcomes.values()} == {("r0-0", "r1-0")}
    assert {mean for mean, _, _ in outcomes.values()} == {reference([0, 1])}


def test_corrupt_contribution_is_excluded_and_named(make_backend):
    backend = make_backend("path")
    store = backend.store()
    codec, meta = (
        make_codec("fp32"),
        wire.ObjectMeta(run="run", round=0, replica="bad", incarnation=0, shard=0),
    )
    encoded = wire.encode(contribution(9), codec, meta)
    checksum = wire.stored_checksum(encoded)
    encoded[-1] ^= 0x01  # one flipped bit in the payload; the prefix still claims the old CRC
    key = RUN.part(0, 0, "bad", 0, 0)
    store.put(key, encoded)
    manifest = Manifest(
        run="run", round=0, fragment=0, replica="bad", incarnation=0, weight=1.0,
        fingerprint="", codec=codec, numel=NUMEL,
        parts=(PartEntry(key=key, size=len(encoded), crc32c=checksum, start=0, stop=NUMEL),),
    )  # fmt: skip
    store.put(RUN.manifest(0, 0, "bad", 0), encode_record(manifest))
    policy = RoundPolicy(min_replicas=2, grace=1.0, timeout=60.0, part_elements=NUMEL)
    outcomes = run_replicas(backend, [0, 1], ["r0", "r1", "bad"], policy)
    for _, contributors, excluded in outcomes.values():
        assert contributors == ("r0-0", "r1-0")
        assert list(excluded) == ["bad-0"]
        assert excluded["bad-0"].startswith(f"{key}: checksum mismatch")
    assert {mean for mean, _, _ in outcomes.values()} == {reference([0, 1])}


def test_timeout_names_round_missing_members_and_store():
    store = Store("memory://gather-timeout")
    round_ = GatherRound(
        store, RUN, 3, 1, Participant("r0", 0), [Participant("r0", 0), Participant("r1", 0)],
        RoundPolicy(min_replicas=2, grace=0.1, timeout=0.5),
    )  # fmt: skip
    round_.contribute(contribution(0), 1.0, make_codec("fp32"))
    with pytest.raises(
        RoundTimeoutError, match=r"round 3 fragment 1: .*missing \['r1-0'\].*memory://gather"
    ):
        round_.result()
