"""torchft's own DiLoCo over ``BucketManager``, against torchft's own Manager.

The same two-replica run, once with torchft's Manager (a Lighthouse and ProcessGroupGloo, all on
CPU) and once with ours over a local store (fp32 codec), must end with the same parameters.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from torch import nn

from diloco_anywhere.bench.tools.processes import worker_context
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.allreduce import BucketCollective
from diloco_anywhere.collective.policy import CollectiveConfig, RoundPolicy
from diloco_anywhere.training.managers.bucket import BucketManager

pytestmark = pytest.mark.integration  # every test here starts processes

SYNC_EVERY = 4  # inner steps per outer step (H)
OUTER_STEPS = 4


def make_model() -> nn.Module:
    torch.manual_seed(0)  # every replica starts from the same weights
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def train(manager, replica: int, fragments: int, delay: int, bucketize: bool) -> dict[str, list]:
    """torchft's DiLoCo with the paper's optimizers (inner AdamW; outer SGD, Nesterov, lr 0.7,
    momentum 0.9) on replica-specific data, until OUTER_STEPS commits."""
    from torchft.local_sgd import DiLoCo

    model = make_model()
    parts = [model] if fragments == 1 else [model[0], model[2]]
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outers = [
        torch.optim.SGD(part.parameters(), lr=0.7, momentum=0.9, nesterov=True) for part in parts
    ]
    data = torch.Generator().manual_seed(100 + replica)
    with DiLoCo(
        manager, parts, inner, outers, sync_every=SYNC_EVERY, pin_memory=False,
        fragment_sync_delay=delay, use_bucketization=bucketize, bucket_cap_mb=1,
    ):  # fmt: skip
        for _ in range(4 * SYNC_EVERY * OUTER_STEPS):  # bounded: a failing sync does not commit
            if manager.current_step() >= OUTER_STEPS * fragments:
                break
            inputs = torch.randn(16, 8, generator=data)
            targets = inputs[:, :4].sin()
            inner.zero_grad()
            nn.functional.mse_loss(model(inputs), targets).backward()
            inner.step()
    return {name: value.tolist() for name, value in model.state_dict().items()}  # exact floats


def _ours(url, replica, fragments, delay, bucketize, barrier, results):
    config = CollectiveConfig(
        round=RoundPolicy(min_replicas=2, grace=30.0, timeout=60.0, expected_replicas=2)
    )
    collective = BucketCollective(Store(url), "run", f"r{replica}", config)
    barrier.wait()  # both are members before the first round
    manager = BucketManager(collective, min_replicas=2)
    try:
        results.put(
            (replica, train(manager, replica, fragments, delay, bucketize), manager.current_step())
        )
    finally:
        manager.shutdown()


def _torchft(lighthouse, replica, fragments, delay, bucketize, barrier, results):
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(), min_replica_size=2, load_state_dict=None, state_dict=None,
        replica_id=f"r{replica}", store_addr="localhost", store_port=store.port, rank=0,
        world_size=1, lighthouse_addr=lighthouse, use_async_quorum=False,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    try:
        results.put(
            (replica, train(manager, replica, fragments, delay, bucketize), manager.current_step())
        )
    finally:
        manager.shutdown(wait=False)


def run_pair(target, where, fragments, delay, bucketize) -> list[dict[str, torch.Tensor]]:
    context = worker_context()
    barrier, results = context.Barrier(2), context.Queue()
    processes = [
        context.Process(
            target=target, args=(where, i, fragments, delay, bucketize, barrier, results)
        )
        for i in range(2)
    ]
    for process in processes:
        process.start()
    outcomes = {}
    for _ in processes:
        replica, params, step = results.get(timeout=240)
        outcomes[replica] = ({name: torch.tensor(value) for name, value in params.items()}, step)
    for process in processes:
        process.join(timeout=60)
    assert [outcomes[i][1] for i in range(2)] == [OUTER_STEPS * fragments] * 2
    return [outcomes[i][0] for i in range(2)]


@pytest.mark.parametrize(
    ("fragments", "delay", "bucketize"), [(1, 0, False), (2, 1, False), (1, 0, True)]
)
def test_bucket_manager_matches_torchfts_manager(tmp_path, fragments, delay, bucketize):
    """DiLoCo (1 fragment), Streaming DiLoCo (2 fragments, tau = 1), and DiLoCo with
    bucketized allreduce (results copied back in a ``then`` callback)."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        reference = run_pair(_torchft, lighthouse.address(), fragments, delay, bucketize)
    finally:
        lighthouse.shutdown()
    ours = run_pair(_ours, str(tmp_path), fragments, delay, bucketize)
    initial = make_model().state_dict()
    # The run ends at the last fragment's sync: that fragment holds the global weights on both
    # replicas; an earlier fragment has taken local steps since its own sync.
    last_synced = [name for name in initial if fragments == 1 or name.startswith("2.")]
    for name in last_synced:
        assert torch.equal(ours[0][name], ours[1][name]), name  # replicas agree bit for bit
        assert torch.equal(reference[0][name], reference[1][name]), name
    for name in initial:
        assert not torch.equal(ours[0][name], initial[name]), name  # it trained
        for replica in (0, 1):
            torch.testing.assert_close(
                ours[replica][name], reference[replica][name], rtol=1e-5, atol=1e-7
            )
