"""The reduction after a SEAL (collective/exchanges/reduction.py): several shards at a time on
the device of the tensors, the same bits whatever the number of reducers or the device, memory
held to the window, every buffer given back when a round fails, and where the time went.
Rounds run as threads of this process through a store in memory: no process is started."""

from __future__ import annotations

import threading

import pytest
import torch

from diloco_anywhere.bench.gpu.device_sync import (
    AGREEMENT_NUMEL,
    AGREEMENT_REPLICAS,
    agreed_mean,
    device_mean,
)
from diloco_anywhere.bench.store import sample_tensor
from diloco_anywhere.bucket.codecs.codec import make_codec
from diloco_anywhere.bucket.format import wire
from diloco_anywhere.bucket.format.layout import Participant, RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.errors import SealedContributionError
from diloco_anywhere.collective.exchanges import reduction
from diloco_anywhere.collective.exchanges.reduction import Slots, reducer_count
from diloco_anywhere.collective.mean import weighted_mean
from diloco_anywhere.collective.parts import Transfers
from diloco_anywhere.collective.phases import PHASES
from diloco_anywhere.collective.round import Round, RoundPolicy
from support.rounds import finish_in_threads

RUN = RunLayout("run")
META = wire.ObjectMeta(run="run", round=0, replica="a", incarnation=0, shard=0)
NUMEL = 50_000
NAMES = ("a", "b", "c")
MODES = ("gather", "sharded")


def contributions() -> list[torch.Tensor]:
    return [sample_tensor("student_t", NUMEL, seed=i) for i in range(len(NAMES))]


def run_round(mode: str, codec: str = "fp32", *, window: int = 8, **policy_fields):
    """Each of ``NAMES`` contributes its tensor (weights 1, 2, 3) in a thread of its own; the
    tensors it gets back, the results (or errors) and each round's transfers."""
    policy = RoundPolicy(
        grace=60.0, timeout=60.0, mode=mode, expected_replicas=len(NAMES), part_elements=2048,
        window=window, **policy_fields,
    )  # fmt: skip
    store = Store(f"memory://reduction-{mode}-{codec}-{id(policy)}")
    members = [Participant(name, 0) for name in NAMES]
    received = [tensor.clone() for tensor in contributions()]
    rounds = {}
    for index, name in enumerate(NAMES):
        transfers = Transfers.create(window)
        rounds[name] = Round(store, RUN, 0, 0, Participant(name, 0), members, policy,
                             transfers=transfers)  # fmt: skip
        rounds[name].contribute(received[index], index + 1.0, make_codec(codec))
    return received, finish_in_threads(rounds), rounds


def reference() -> torch.Tensor:
    return weighted_mean([(tensor, i + 1.0) for i, tensor in enumerate(contributions())])


@pytest.mark.parametrize("codec", ["fp32", "int8"])
@pytest.mark.parametrize("mode", MODES)
def test_the_bits_do_not_depend_on_how_many_shards_are_reduced_at_once(mode, codec):
    """One reducer, four, and a window of one part shared by four reducers (the earliest
    shard can always finish: no deadlock): every replica, every way, the same bytes; fp32 in
    gather mode equal to the reference order's mean."""
    results = {}
    for reducers, window in ((1, 8), (4, 8), (4, 1)):
        received, outcomes, _ = run_round(mode, codec, window=window, reducers=reducers)
        assert all(not isinstance(o, Exception) for o in outcomes.values()), outcomes
        assert {o.seal.mode for o in outcomes.values()} == {mode}
        assert all(torch.equal(tensor, received[0]) for tensor in received)
        results[reducers, window] = received[0]
    assert torch.equal(results[1, 8], results[4, 8])
    assert torch.equal(results[1, 8], results[4, 1])
    if codec == "fp32":
        assert torch.equal(results[1, 8], reference())


def test_parts_held_never_exceed_the_slots(monkeypatch):
    """Four reducers, three slots: at no moment does a replica hold more than three parts
    fetched and not yet added, though it reduces four shards at once."""
    held: dict[int, int] = {}
    most: dict[int, int] = {}
    lock = threading.Lock()
    take, give = Slots.take, Slots.give

    def counted_take(self):
        taken = take(self)
        with lock:
            held[id(self)] = held.get(id(self), 0) + taken
            most[id(self)] = max(most.get(id(self), 0), held[id(self)])
        return taken

    def counted_give(self):
        with lock:
            held[id(self)] -= 1
        give(self)

    monkeypatch.setattr(Slots, "take", counted_take)
    monkeypatch.setattr(Slots, "give", counted_give)
    received, _, _ = run_round("gather", window=3, reducers=4)
    assert torch.equal(received[0], reference())
    assert len(most) == len(NAMES)  # a gather round: one reduction per replica, no publishing
    assert set(most.values()) == {3}
    assert set(held.values()) == {0}


def test_a_corrupt_part_fails_the_round_and_no_reducer_is_left_behind(monkeypatch):
    """Part 5 of b fails its checks on read (as a flipped bit would): its reducer publishes
    the failure, every replica fails naming the part's key, and every reducer thread ends."""
    real_chunks = reduction.Part.chunks

    def chunks(self, *args, **kwargs):
        if self.name == "b-0" and self.shard == 5 and not self.trusted:
            raise wire.WireFormatError(self.entry.key, "checksum mismatch (test)")
        return real_chunks(self, *args, **kwargs)

    monkeypatch.setattr(reduction.Part, "chunks", chunks)
    _, outcomes, _ = run_round("sharded", reducers=4)
    key = RUN.part(0, 0, "b", 0, 5)
    assert all(isinstance(o, SealedContributionError) for o in outcomes.values()), outcomes
    assert all(key in str(outcome) for outcome in outcomes.values())
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("reduce")]


def test_a_round_says_where_its_time_went():
    _, outcomes, _ = run_round("sharded", "int8")
    for outcome in outcomes.values():
        assert set(outcome.seconds) == set(PHASES)
        for phase in ("transfer", "checksum", "decode", "reduce", "encode"):
            assert outcome.seconds[phase] > 0, (phase, outcome.seconds)


def test_reducers_fit_the_cores_and_the_window():
    cores = len(__import__("os").sched_getaffinity(0))
    assert reducer_count(torch.device("cpu"), 64) == cores
    assert reducer_count(torch.device("cpu"), 1) == 1
    assert reducer_count(torch.device("cuda"), 64) == reduction.GPU_REDUCERS


@pytest.mark.parametrize("mode", MODES)
def test_the_device_checks_mean_is_the_int8_mean_of_what_each_replica_sent(mode):
    """``make gpu-check`` compares a GPU's mean with this one, so it must be right here:
    gather's is the reference mean of the decoded int8 contributions, bit for bit; sharded's
    is that mean quantized once more (its reduced shards are int8)."""
    codec = make_codec("int8")
    sent = [
        wire.decode(wire.encode(sample_tensor("student_t", AGREEMENT_NUMEL, seed=i), codec, META))
        for i in range(AGREEMENT_REPLICAS)
    ]
    exact = weighted_mean([(decoded.tensor, i + 1.0) for i, decoded in enumerate(sent)])
    mean = device_mean(torch.device("cpu"), mode)
    if mode == "gather":
        assert torch.equal(mean, exact)
    else:
        assert 0 < float((mean - exact).norm() / exact.norm()) < 0.02  # int8 once more


def test_the_device_checks_mean_raises_a_replicas_error_in_the_callers_thread():
    """A replica thread that fails (here: tensors on the meta device, which hold no values)
    fails the check with its own error instead of a mean of what the others did."""
    with pytest.raises(RuntimeError, match="meta tensors"):
        device_mean(torch.device("meta"), "gather")


def test_replicas_whose_means_differ_in_one_bit_fail_the_device_check():
    mean = torch.arange(4.0)
    assert agreed_mean([mean, mean.clone()], "r") is mean
    nudged = mean.clone()
    nudged[3] = torch.nextafter(nudged[3], torch.tensor(9.0))
    with pytest.raises(AssertionError, match="r: the replicas' means differ"):
        agreed_mean([mean, nudged], "r")
