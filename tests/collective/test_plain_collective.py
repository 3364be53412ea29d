"""``diloco_anywhere.Collective``: the all-reduce alone, from a store URL and a name."""

from __future__ import annotations

import threading

import pytest
import torch

from diloco_anywhere import Collective


def _together(*calls):
    """Run each ``(collective, tensor, weight)``'s allreduce on its own thread; their results."""
    results: dict[int, torch.Tensor] = {}

    def run(k: int, collective: Collective, tensor: torch.Tensor, weight: float) -> None:
        results[k] = collective.allreduce(tensor, weight)

    threads = [threading.Thread(target=run, args=(k, *call)) for k, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [results[k] for k in range(len(calls))]


def test_rounds_give_the_weighted_mean_in_place(tmp_path):
    url = str(tmp_path / "store")
    with Collective(url, "a", replicas=2) as a, Collective(url, "b", replicas=2) as b:
        x, y = torch.zeros(5), torch.full((5,), 3.0)
        returned = _together((a, x, 1.0), (b, y, 2.0))
        assert returned[0] is x  # in place
        assert returned[1] is y
        assert x.tolist() == y.tolist() == [2.0] * 5  # (0 * 1 + 3 * 2) / 3
        again = _together((a, torch.ones(2), 1.0), (b, torch.full((2,), 5.0), 1.0))
        assert [t.tolist() for t in again] == [[3.0, 3.0]] * 2


def test_a_late_replica_gets_the_others_mean_and_a_restarted_one_joins_the_next_round(tmp_path):
    url = str(tmp_path / "store")
    with Collective(url, "a", replicas=2) as a, Collective(url, "b", replicas=2) as b:
        _together((a, torch.zeros(3), 1.0), (b, torch.zeros(3), 1.0))  # round 0, both in
        with Collective(url, "a", replicas=2, min_replicas=1, grace=0.2) as hasty:
            assert hasty.allreduce(torch.ones(3)).tolist() == [1.0] * 3  # round 1, sealed alone
        late = b.allreduce_async(torch.zeros(3))  # b's round 1
        late.wait()
        assert late.tensor.tolist() == [1.0] * 3  # the others' mean; its zeros dropped
        assert late.result().seal.contributors == ("a-1",)
    # both back (restarted): numbered on from the newest sealed round, they meet in round 2
    with Collective(url, "a", replicas=2) as a, Collective(url, "b", replicas=2) as restarted:
        pair = _together((a, torch.zeros(3), 1.0), (restarted, torch.full((3,), 2.0), 1.0))
        assert [t.tolist() for t in pair] == [[1.0] * 3] * 2
        round_ = a.allreduce_async(torch.zeros(1))
        restarted.allreduce(torch.zeros(1))
        round_.wait()
        assert round_.result().seal.round == 3


def test_the_sparse_codec_is_refused_without_error_feedback(tmp_path):
    """A plain all-reduce would lose what the top-k leaves out: only a DiLoCo run, whose
    error feedback sends it later, takes ``sparse``."""
    with pytest.raises(ValueError, match=r'which a DiLoCo run has .* codec = "sparse"'):
        Collective(str(tmp_path), "a", replicas=1, codec="sparse")
