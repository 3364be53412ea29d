"""Rounds in both exchange modes across separate OS processes sharing only a store."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import asdict, replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from diloco_anywhere.bench.store import sample_tensor
from diloco_anywhere.bench.tools.processes import worker_context
from diloco_anywhere.bucket.codecs.codec import make_codec, reduced_codec
from diloco_anywhere.bucket.format import framing, wire
from diloco_anywhere.bucket.format.layout import Participant, RunLayout
from diloco_anywhere.bucket.format.record import decode_record, encode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.allreduce import finish_round
from diloco_anywhere.collective.errors import (
    DivergedError,
    RoundTimeoutError,
    SealedContributionError,
)
from diloco_anywhere.collective.flat import FlatTensors
from diloco_anywhere.collective.mean import weighted_mean
from diloco_anywhere.collective.parts import part_ranges
from diloco_anywhere.collective.records import Manifest, PartEntry, Seal
from diloco_anywhere.collective.round import Round, RoundPolicy

RUN = RunLayout("run")
META = wire.ObjectMeta(run="run", round=0, replica="a", incarnation=0, shard=0)
NUMEL = 10_000
PARTS = 4_096  # several parts per contribution, the last one short
MODES = ("gather", "sharded")


def contribution(index: int) -> torch.Tensor:
    return sample_tensor("student_t", NUMEL, seed=index)


def weight(index: int) -> float:
    return float(100 * (index + 1))  # unequal, e.g. tokens processed


def policy(mode: str, replicas: int, **changes) -> RoundPolicy:
    base = RoundPolicy(
        min_replicas=1,
        grace=60.0,  # every member is expected: sealing waits for all of them, however slow
        timeout=60.0,
        mode=mode,
        expected_replicas=replicas,
        orphan_grace=2.0,
        part_elements=PARTS,
    )
    return replace(base, **changes)


def _replica(url, options, index, members, policy_fields, codec, delay, late, die, results):
    time.sleep(delay)
    store = Store(url, storage_options=options)
    while late and store.get_many([RUN.seal(0, 0)], limit=1 << 20)[RUN.seal(0, 0)] is None:
        time.sleep(0.05)  # a late replica: it contributes only once the round is sealed
    me = Participant(f"r{index}", 0)
    round_ = Round(
        store, RUN, 0, 0, me, [Participant(m, 0) for m in members], RoundPolicy(**policy_fields)
    )
    tensor = contribution(index)  # receives the mean in place
    round_.contribute(tensor, weight(index), make_codec(codec))
    if die:  # a replica lost right after contributing: its shards are orphans
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        result = finish_round(round_)
        mean = tensor.numpy().tobytes()
        results.put((me.replica, mean, result.seal, result.excluded))
    except Exception as exc:
        results.put((me.replica, f"error: {exc}", None, {}))


def run_replicas(backend, indices, members, policy, codec="fp32", delays=None, late=(), dying=()):
    """Run replica ``indices`` as processes; return {replica: (mean or error, seal, excluded)}."""
    context = worker_context()
    results = context.Queue()
    delays = delays or {}
    shared = (backend.url, backend.storage_options)
    processes = [
        context.Process(
            target=_replica,
            args=(
                *shared,
                i,
                members,
                asdict(policy),
                codec,
                delays.get(i, 0.0),
                i in late,
                i in dying,
                results,
            ),
        )
        for i in indices
    ]
    for process in processes:
        process.start()
    outcomes = {}
    for _ in range(len(processes) - len(dying)):
        replica, mean, seal, excluded = results.get(timeout=120)
        outcomes[replica] = (mean, seal, excluded)
    for process in processes:
        process.join(timeout=30)
    return outcomes


def means(outcomes) -> set:
    errors = {r: m for r, (m, _, _) in outcomes.items() if isinstance(m, str)}
    assert not errors, errors
    return {mean for mean, _, _ in outcomes.values()}


def contributors(outcomes) -> set:
    return {seal.contributors for _, seal, _ in outcomes.values()}


def reference(indices) -> bytes:
    pairs = [(contribution(i), weight(i)) for i in sorted(indices, key=lambda i: f"r{i}-0")]
    return weighted_mean(pairs).numpy().tobytes()


@pytest.mark.parametrize(
    ("name", "replicas", "mode"),
    [
        ("path", 2, "gather"),
        ("path", 8, "gather"),
        ("s3", 3, "gather"),
        ("path", 3, "sharded"),
        ("path", 8, "sharded"),
        ("s3", 4, "sharded"),
        ("hf", 2, "gather"),
        ("hf", 3, "sharded"),
    ],
)
def test_all_replicas_get_identical_bytes_equal_to_the_reference_mean(
    make_backend, name, replicas, mode
):
    """fp32 in either mode is bit-exact against the reference order (mean.py)."""
    indices = range(replicas)
    members = [f"r{i}" for i in indices]
    outcomes = run_replicas(make_backend(name), indices, members, policy(mode, replicas))
    assert means(outcomes) == {reference(indices)}
    assert contributors(outcomes) == {tuple(sorted(f"{m}-0" for m in members))}
    assert {seal.mode for _, seal, _ in outcomes.values()} == {mode}


@pytest.mark.parametrize("mode", MODES)
def test_int8_mean_is_within_the_codec_bound(make_backend, mode):
    """Sharded mode quantizes twice (contributions, then reduced shards): still < 2%."""
    outcomes = run_replicas(
        make_backend("path"), range(4), ["r0", "r1", "r2", "r3"], policy(mode, 4), "int8"
    )
    (mean_bytes,) = means(outcomes)
    mean = torch.frombuffer(bytearray(mean_bytes), dtype=torch.float32)
    exact = torch.frombuffer(bytearray(reference(range(4))), dtype=torch.float32)
    assert 0 < float((mean - exact).norm() / exact.norm()) < 0.02


@pytest.mark.parametrize("mode", MODES)
def test_absent_member_is_sealed_out_after_the_grace_window(make_backend, mode):
    """Sharded: three shards over two owners, so one owner reduces two."""
    outcomes = run_replicas(
        make_backend("path"), [0, 1], ["r0", "r1", "r2"],
        policy(mode, 3, min_replicas=2, grace=1.0),
    )  # fmt: skip
    assert contributors(outcomes) == {("r0-0", "r1-0")}
    assert means(outcomes) == {reference([0, 1])}


@pytest.mark.parametrize("mode", MODES)
def test_late_replica_is_excluded_but_gets_the_same_result(make_backend, mode):
    outcomes = run_replicas(
        make_backend("path"), [0, 1, 2], ["r0", "r1", "r2"],
        policy(mode, 3, min_replicas=2, grace=0.5), late={2},
    )  # fmt: skip
    assert contributors(outcomes) == {("r0-0", "r1-0")}
    assert means(outcomes) == {reference([0, 1])}


def test_orphaned_shards_of_a_killed_owner_are_reduced_by_the_others(make_backend):
    """r0 contributes, is sealed, and is SIGKILLed before reducing its shards."""
    outcomes = run_replicas(
        make_backend("path"), [0, 1, 2], ["r0", "r1", "r2"], policy("sharded", 3, grace=30.0),
        delays={1: 1.0, 2: 1.0}, dying={0},
    )  # fmt: skip
    assert set(outcomes) == {"r1", "r2"}
    assert contributors(outcomes) == {("r0-0", "r1-0", "r2-0")}
    assert means(outcomes) == {reference([0, 1, 2])}


def _corrupt_contribution(store: Store, bad_part: bool) -> str:
    """A contribution by member "bad": one flipped payload bit, or a manifest whose record
    checksum no longer matches. Returns the key of the damaged object."""
    codec = make_codec("fp32")
    ranges = part_ranges(NUMEL, codec, PARTS, 3)
    entries = []
    for shard, elements in enumerate(ranges):
        meta = wire.ObjectMeta(run="run", round=0, replica="bad", incarnation=0, shard=shard)
        encoded = wire.encode(contribution(9)[elements.start : elements.stop], codec, meta)
        checksum = framing.stored_checksum(encoded)
        if bad_part and shard == 1:
            encoded[-1] ^= 0x01  # the prefix still claims the old CRC
        key = RUN.part(0, 0, "bad", 0, shard)
        store.put(key, encoded)
        entries.append(
            PartEntry(
                key=key, size=len(encoded), crc32c=checksum,
                start=elements.start, stop=elements.stop,
            )
        )  # fmt: skip
    manifest = encode_record(
        Manifest(
            run="run", round=0, fragment=0, replica="bad", incarnation=0, weight=1.0,
            fingerprint="", codec=codec, numel=NUMEL, parts=tuple(entries),
        )
    )  # fmt: skip
    if not bad_part:
        manifest = manifest[:-2] + b"9}"  # a digit changed in the JSON body
    store.put(RUN.manifest(0, 0, "bad", 0), manifest)
    return RUN.part(0, 0, "bad", 0, 1) if bad_part else RUN.manifest(0, 0, "bad", 0)


@pytest.mark.parametrize(("mode", "bad_part"), [("gather", True), ("sharded", False)])
def test_corrupt_contribution_is_excluded_before_sealing_and_named(make_backend, mode, bad_part):
    """Gather checks whole contributions before sealing; sharded checks manifests. The
    sealer has checked the bad contribution and names it; the other replica names it too if
    it got to check it before the SEAL appeared (a matter of timing), and never seals it."""
    backend = make_backend("path")
    key = _corrupt_contribution(backend.store(), bad_part)
    outcomes = run_replicas(
        backend, [0, 1], ["r0", "r1", "bad"], policy(mode, 3, min_replicas=2, grace=1.0)
    )
    [sealer] = {seal.sealed_by for _, seal, _ in outcomes.values()}
    for replica, (_, seal, excluded) in outcomes.items():
        assert seal.contributors == ("r0-0", "r1-0")
        assert (
            list(excluded) == ["bad-0"]
            if f"{replica}-0" == sealer
            else list(excluded) in ([], ["bad-0"])
        )
        for reason in excluded.values():
            assert reason.startswith(f"{key}: checksum mismatch")
    assert means(outcomes) == {reference([0, 1])}


def test_corrupt_sealed_part_fails_the_round_on_every_replica_naming_it(make_backend):
    """Sharded seals on manifests; the owner of the bad part's shard finds it, records the
    failure at the shard's key, and every replica fails alike: nothing is averaged."""
    backend = make_backend("path")
    key = _corrupt_contribution(backend.store(), bad_part=True)
    outcomes = run_replicas(backend, [0, 1], ["r0", "r1", "bad"], policy("sharded", 3))
    seal = decode_record(backend.store().get(RUN.seal(0, 0)), Seal, key="SEAL")
    assert seal.contributors == ("bad-0", "r0-0", "r1-0")
    for mean, _, _ in outcomes.values():
        assert isinstance(mean, str)
        assert "round 0 fragment 0 shard 1: sealed part" in mean
        assert f"{key} is unreadable: checksum mismatch" in mean


def test_timeout_names_round_missing_members_and_store():
    store = Store("memory://round-timeout")
    round_ = Round(
        store, RUN, 3, 1, Participant("r0", 0), [Participant("r0", 0), Participant("r1", 0)],
        RoundPolicy(min_replicas=2, grace=0.1, timeout=0.5),
    )  # fmt: skip
    round_.contribute(contribution(0), 1.0, make_codec("fp32"))
    with pytest.raises(
        RoundTimeoutError,
        match=r"round 3 fragment 1: .*missing r1-0 \(joined, sent nothing\).*memory://round",
    ):
        round_.wait_for_seal()


def _polls_while_waiting(policy: RoundPolicy, seconds: float) -> list[float]:
    """The delays a wait of ``seconds`` goes through, on a clock that the delays advance."""
    now = [0.0]
    delays, waited = policy.poll_delays(clock=lambda: now[0]), []
    while now[0] < seconds:
        waited.append(next(delays))
        now[0] += waited[-1]
    return waited


def test_polling_is_prompt_while_a_wait_is_young():
    policy = RoundPolicy()
    delays = _polls_while_waiting(policy, 4.0)
    assert max(delays) <= policy.poll_max
    assert len(delays) >= 4.0 / policy.poll_max


def test_a_long_wait_polls_less_and_less_up_to_the_cap():
    """A 10-minute straggler costs a waiting replica a few hundred polls (each one GET of the
    SEAL and one per missing manifest), not the ~5,000 of a flat 50-200 ms backoff."""
    policy = RoundPolicy()
    delays = _polls_while_waiting(policy, 600.0)
    assert max(delays) <= policy.poll_cap
    assert max(delays[-50:]) > 4 * policy.poll_max  # the ceiling grew with the wait
    assert len(delays) < 500


@pytest.mark.parametrize(
    ("contributors", "payload", "mode"),
    [
        (1, 1 << 30, "gather"),
        (2, 256 << 20, "gather"),  # sharding saves nothing at n = 2
        (2, 1 << 30, "sharded"),  # but the other's 1 GiB would not fit gather_memory
        (3, 64 << 20, "gather"),  # saves P/3 = 21 MiB
        (3, 256 << 20, "sharded"),  # saves 85 MiB
        (8, 1 << 20, "gather"),  # saves 5 MiB: latency dominates
        (8, 16 << 20, "sharded"),  # saves 84 MiB
    ],
)
def test_auto_mode_shards_when_it_saves_enough_download(contributors, payload, mode):
    assert RoundPolicy().exchange_mode(contributors, payload) == mode
    assert RoundPolicy(mode="gather").exchange_mode(contributors, payload) == "gather"


@pytest.mark.parametrize(
    ("contributors", "mode"),
    [
        (2, "gather"),  # 78 MB against 570 MB: a sparse result in int8 is 14 times larger
        (9, "gather"),  # 621 MB, 353 MB of it read twice: 974 MB against 1,013 MB
        (10, "sharded"),  # 1,129 MB against 1,026 MB: the 98 MiB it saves pay
    ],
)
def test_auto_mode_gathers_sparse_contributions_while_that_moves_fewer_bytes(contributors, mode):
    """1B parameters at the default 8%: 78 MB a contribution, 1.06 GB reduced in int8."""
    codec = make_codec("sparse")
    payload, reduced = (c.payload_nbytes(10**9) for c in (codec, reduced_codec(codec)))
    assert RoundPolicy().exchange_mode(contributors, payload, reduced) == mode


@given(
    numel=st.integers(1, 50_000),
    codec=st.sampled_from([make_codec("fp32"), make_codec("int8", block=64)]),
    part_elements=st.integers(1, 20_000),
    multiple=st.integers(1, 8),
)
def test_parts_tile_the_tensor_in_whole_blocks_and_come_in_multiples(
    numel, codec, part_elements, multiple
):
    ranges = part_ranges(numel, codec, part_elements, multiple)
    align = getattr(codec, "block", 1)
    assert [r.start for r in ranges[1:]] == [r.stop for r in ranges[:-1]]
    assert (ranges[0].start, ranges[-1].stop) == (0, numel)
    assert all(r.start % align == 0 and len(r) > 0 for r in ranges)
    if len(ranges) < -(-numel // align):  # else there are too few blocks: one part each
        assert len(ranges) % multiple == 0
        assert max(map(len, ranges)) < part_elements + align
    sizes = [len(r) for r in ranges[:-1]]  # the last part may be short by a partial block
    assert not sizes or max(sizes) - min(sizes) <= align


def _rounds_in_threads(store, contributions, policy_fields, codec=None):
    """Contribute a copy of each (name, tensor, fingerprint) in order, then finish all rounds
    at once; each copy receives its round's mean."""
    members = [Participant(name, 0) for name, _, _ in contributions]
    rounds, received = {}, {}
    for name, tensor, fingerprint in contributions:
        rounds[name] = Round(store, RUN, 0, 0, Participant(name, 0), members, policy_fields)
        received[name] = tensor.clone()
        rounds[name].contribute(received[name], 1.0, codec or make_codec("fp32"), fingerprint)
    outcomes = {}

    def finish(name):
        try:
            outcomes[name] = finish_round(rounds[name])
        except Exception as exc:
            outcomes[name] = exc

    threads = [threading.Thread(target=finish, args=(name,)) for name in reversed(rounds)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes, received


@pytest.mark.parametrize("mode", MODES)
def test_a_sparse_round_averages_what_each_replica_sent(mode):
    """gather: the mean of the decoded contributions, bit for bit in the reference order;
    sharded: that mean once more in int8, the reduced shards' codec, within int8's bound,
    the same bytes on every replica."""
    codec = make_codec("sparse", chunk=256, k=16, bits=2)
    tensors = [sample_tensor("student_t", 3000, seed=i) for i in range(3)]
    outcomes, received = _rounds_in_threads(
        Store(f"memory://rounds-sparse-{mode}"),
        [(name, tensor, "f") for name, tensor in zip("abc", tensors, strict=True)],
        RoundPolicy(grace=30.0, timeout=30.0, mode=mode, expected_replicas=3, part_elements=512),
        codec,
    )
    sent = [wire.decode(wire.encode(tensor, codec, META)).tensor for tensor in tensors]
    exact = weighted_mean([(tensor, 1.0) for tensor in sent])
    assert {outcome.seal.mode for outcome in outcomes.values()} == {mode}
    assert all(torch.equal(received[name], received["a"]) for name in "bc")
    if mode == "gather":
        assert torch.equal(received["a"], exact)
    else:
        assert 0 < float((received["a"] - exact).norm() / exact.norm()) < 0.01


def test_a_replica_whose_weights_differ_is_left_out_and_fails_loudly():
    """c missed a commit (another fingerprint): a and b seal without it; c, in the minority,
    does not seal, and refuses the result instead of applying it to other weights."""
    store = Store("memory://rounds-fingerprint")
    tensors = [sample_tensor("gaussian", 100, seed=i) for i in range(3)]
    outcomes, received = _rounds_in_threads(
        store,
        [
            ("a", tensors[0], "step-4-aa"),
            ("b", tensors[1], "step-4-aa"),
            ("c", tensors[2], "step-3-cc"),
        ],
        RoundPolicy(grace=0.2, timeout=30.0),
    )
    for name in ("a", "b"):
        assert outcomes[name].seal.contributors == ("a-0", "b-0")
        expected = weighted_mean([(tensors[0], 1.0), (tensors[1], 1.0)])
        assert torch.equal(received[name], expected)
    assert isinstance(outcomes["c"], DivergedError)  # the replica heals on this error
    assert "this replica's global state (step-3-cc) differs" in str(outcomes["c"])


def test_a_result_laid_out_unlike_what_a_replica_sent_is_refused():
    store = Store("memory://rounds-layout")
    big, small = sample_tensor("gaussian", 200, seed=0), sample_tensor("gaussian", 100, seed=1)
    policy = RoundPolicy(grace=0.2, timeout=30.0)
    sealed = Round(store, RUN, 0, 0, Participant("a", 0), [Participant("a", 0)], policy)
    sealed.contribute(big, 1.0, make_codec("fp32"))
    assert finish_round(sealed).seal.contributors == ("a-0",)
    late = Round(store, RUN, 0, 0, Participant("b", 0), [Participant("b", 0)], policy)
    late.contribute(small, 1.0, make_codec("fp32"))
    with pytest.raises(SealedContributionError, match="this replica sent 100 values"):
        finish_round(late)


def test_a_replica_that_contributed_nothing_reads_the_mean_into_a_destination_it_names():
    store = Store("memory://rounds-observer")
    tensor = sample_tensor("gaussian", 300, seed=2)
    policy = RoundPolicy(grace=0.2, timeout=30.0)
    sealed = Round(store, RUN, 0, 0, Participant("a", 0), [Participant("a", 0)], policy)
    sealed.contribute(tensor, 1.0, make_codec("fp32"))
    finish_round(sealed)

    def observer() -> Round:
        return Round(store, RUN, 0, 0, Participant("b", 0), [Participant("a", 0)], policy)

    with pytest.raises(ValueError, match="needs a destination when this replica contributed"):
        finish_round(observer())
    destination = torch.zeros(300)
    result = finish_round(observer(), FlatTensors([destination]))
    assert result.seal.contributors == ("a-0",)
    assert torch.equal(destination, tensor)
