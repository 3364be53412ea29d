"""torchft's own DiLoCo over ``BucketManager`` with the sparse codec and error feedback is
SparseLoCo (arXiv 2508.15706, Algorithm 1), step for step: each replica sends the top-k of
its decayed accumulator, keeps what the codec dropped, and the outer step applies the mean as
it is. A sync whose mean does not hold this replica's contribution keeps all of it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import torch
from torch import nn
from torchft.local_sgd import DiLoCo

from diloco_anywhere.bucket.codecs.codec import make_codec
from diloco_anywhere.bucket.feedback import ErrorFeedback
from diloco_anywhere.bucket.format import wire
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.allreduce import BucketCollective
from diloco_anywhere.collective.mean import weighted_mean
from diloco_anywhere.collective.policy import CollectiveConfig, RoundPolicy
from diloco_anywhere.training.managers.bucket import BucketManager

SYNC_EVERY, OUTER_STEPS, REPLICAS = 3, 4, 2
CODEC = make_codec("sparse", chunk=64, k=4, bits=2)  # the model's 420 values: 7 chunks
DECAY, OUTER_LR = 0.9, 1.0
META = wire.ObjectMeta(run="run", round=0, replica="r", incarnation=0, shard=0)


def make_model() -> nn.Module:
    """The same weights every time (built on one thread: the seed is global)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def batches(replica: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    data = torch.Generator().manual_seed(100 + replica)
    while True:
        inputs = torch.randn(16, 8, generator=data)
        yield inputs, inputs[:, :4].sin()


def inner_step(model: nn.Module, inner: torch.optim.Optimizer, batch) -> None:
    inner.zero_grad()
    nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
    inner.step()


def sparseloco() -> list[torch.Tensor]:
    """Algorithm 1 written out: the global weights after OUTER_STEPS."""
    weights = [p.detach().clone() for p in make_model().parameters()]
    models = [make_model() for _ in range(REPLICAS)]
    inners = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    feedback = [ErrorFeedback(DECAY) for _ in range(REPLICAS)]
    data = [batches(replica) for replica in range(REPLICAS)]
    for _ in range(OUTER_STEPS):
        sent = []
        for replica, model in enumerate(models):
            with torch.no_grad():
                for parameter, weight in zip(model.parameters(), weights, strict=True):
                    parameter.copy_(weight)
            for _ in range(SYNC_EVERY):
                inner_step(model, inners[replica], next(data[replica]))
            deltas = [w - p.detach() for w, p in zip(weights, model.parameters(), strict=True)]
            accumulator = feedback[replica].compensate(0, deltas)
            sent.append((wire.decode(wire.encode(accumulator, CODEC, META)).tensor, 1.0))
            feedback[replica].applied(0, CODEC)
        mean, start = weighted_mean(sent), 0
        for weight in weights:  # SGD without momentum: w - lr * mean
            weight.add_(mean[start : start + weight.numel()].view_as(weight), alpha=-OUTER_LR)
            start += weight.numel()
    return weights


def _replica(
    store: Store, replica: int, model: nn.Module, barrier: threading.Barrier, results: dict
) -> None:
    config = CollectiveConfig(
        codec=CODEC,
        round=RoundPolicy(min_replicas=2, grace=30.0, timeout=30.0, expected_replicas=2),
    )
    collective = BucketCollective(store, "run", f"r{replica}", config)
    barrier.wait()  # both are members before the first round
    manager = BucketManager(collective, min_replicas=2, feedback=ErrorFeedback(DECAY))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR)
    data = batches(replica)
    try:
        with DiLoCo(manager, [model], inner, [outer], sync_every=SYNC_EVERY, pin_memory=False):
            for _ in range(4 * SYNC_EVERY * OUTER_STEPS):  # bounded: a failing sync commits not
                if manager.current_step() >= OUTER_STEPS:
                    break
                inner_step(model, inner, next(data))
        results[replica] = [p.detach().clone() for p in model.parameters()]
    finally:
        manager.shutdown()


def test_diloco_with_the_sparse_codec_is_sparseloco_to_the_bit():
    barrier, results, store = threading.Barrier(REPLICAS), {}, Store("memory://sparseloco")
    threads = [
        threading.Thread(target=_replica, args=(store, r, make_model(), barrier, results))
        for r in range(REPLICAS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    expected = sparseloco()
    assert sorted(results) == list(range(REPLICAS))
    for weights in results.values():
        assert all(torch.equal(a, b) for a, b in zip(weights, expected, strict=True))
    assert not torch.equal(expected[0], make_model()[0].weight)  # it trained


def _sync(manager: BucketManager, tensor: torch.Tensor) -> bool:
    manager.start_quorum()
    manager.allreduce(tensor)
    return manager.should_commit()


def test_a_sync_that_is_not_committed_keeps_the_whole_accumulator():
    """Sealed with one replica where the run needs two: not committed, so nothing of it was
    applied, and the next sync sends it all again (decayed); a committed one keeps only what
    the codec dropped."""
    config = CollectiveConfig(codec=CODEC, round=RoundPolicy(min_replicas=1, grace=0.0))
    with BucketCollective(Store("memory://sparse-uncommitted"), "run", "a", config) as collective:
        feedback = ErrorFeedback(DECAY)
        first, second = torch.linspace(-1, 1, 200), torch.linspace(2, -2, 200)
        uncommitted = BucketManager(collective, min_replicas=2, feedback=feedback)
        assert not _sync(uncommitted, first.clone())  # the clone receives the mean
        assert torch.equal(feedback.residual(0), first)
        committed = BucketManager(collective, min_replicas=1, feedback=feedback)
        committed.load_state_dict({"step": 0, "batches_committed": 0, "sync": 1})  # round 1
        assert _sync(committed, second.clone())
        compensated = DECAY * first + second
        sent = wire.decode(wire.encode(compensated, CODEC, META)).tensor
        assert torch.allclose(feedback.residual(0), compensated - sent)
