"""What a gather round keeps in memory for its exchange (collective/kept_parts.py): its own
parts as uploaded, so the reduction encodes none of them again, within ``gather_memory``;
through a network another replica's checked part takes the room of one of ours. Rounds run
as threads of this process through a store in memory: no process is started."""

from __future__ import annotations

import torch

from diloco_anywhere.bucket.codecs.codec import make_codec
from diloco_anywhere.bucket.format.layout import Participant, RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.kept_parts import KeptParts
from diloco_anywhere.collective.parts import Transfers
from diloco_anywhere.collective.round import Round, RoundPolicy
from diloco_anywhere.collective.transfers import BufferPool, Held
from support.rounds import finish_in_threads

NAMES = ("a", "b")
NUMEL = 40_000
PART_ELEMENTS = 4_096  # 10 parts a contribution


def _gather_round(gather_memory: int) -> tuple[list[torch.Tensor], list[float], list[float]]:
    """Both replicas' int8 gather round: the means they got, and each one's encode
    thread-seconds once it had contributed and once the round was over."""
    policy = RoundPolicy(
        grace=60.0, timeout=60.0, mode="gather", expected_replicas=2,
        part_elements=PART_ELEMENTS, gather_memory=gather_memory,
    )  # fmt: skip
    store = Store(f"memory://kept-{gather_memory}")
    members = [Participant(name, 0) for name in NAMES]
    tensors = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) for i in (0, 1)]
    rounds = {
        member.name: Round(
            store, RunLayout("run"), 0, 0, member, members, policy, transfers=Transfers.create(4)
        )
        for member in members
    }
    for round_, tensor in zip(rounds.values(), tensors, strict=True):
        round_.contribute(tensor, 1.0, make_codec("int8"))
    contributed = [round_.times.seconds()["encode"] for round_ in rounds.values()]
    outcomes = finish_in_threads(rounds)
    assert not any(isinstance(outcome, Exception) for outcome in outcomes.values()), outcomes
    return tensors, contributed, [round_.times.seconds()["encode"] for round_ in rounds.values()]


def test_a_gather_round_reduces_its_own_parts_as_uploaded_encoding_none_again():
    means, contributed, finished = _gather_round(gather_memory=256 << 20)
    assert finished == contributed  # no encode after the uploads
    re_encoded, contributed_again, finished_again = _gather_round(gather_memory=0)
    assert all(f > c for f, c in zip(finished_again, contributed_again, strict=True))
    assert torch.equal(means[0], means[1])
    assert torch.equal(means[0], re_encoded[0])  # the same bytes either way


def _held(pool: BufferPool, nbytes: int) -> Held:
    held = Held(pool)
    held.allocate(nbytes)
    return held.keep(held.view[:nbytes])


def test_through_a_network_anothers_part_takes_the_room_of_our_last_parts():
    pool = BufferPool(keep=0, pinned=False)
    kept = KeptParts(budget=300, own="me", others_first=True)
    for shard in range(3):
        assert kept.offer(("me", shard), _held(pool, 100))
    assert kept.offer(("other", 0), _held(pool, 150))  # ours of shards 2 and 1 make room
    assert [kept.take(("me", shard)) is not None for shard in range(3)] == [True, False, False]
    assert not kept.offer(("other", 1), _held(pool, 400))  # it would not fit even alone
    assert kept.take(("other", 0)) is not None


def test_from_a_store_on_this_machine_our_parts_keep_their_room():
    pool = BufferPool(keep=0, pinned=False)
    kept = KeptParts(budget=300, own="me", others_first=False)
    for shard in range(3):
        assert kept.offer(("me", shard), _held(pool, 100))
    assert not kept.offer(("other", 0), _held(pool, 100))  # read again after the SEAL
    assert all(kept.take(("me", shard)) is not None for shard in range(3))


def test_a_store_says_whether_a_part_read_again_stays_on_this_machine(backend):
    assert backend.store().on_this_machine == (backend.name in ("path", "file", "memory"))
