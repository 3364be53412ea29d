"""Checkpoints as replicas write them, and as another program could rewrite them."""

from __future__ import annotations

import json
import threading

import torch
from crc32c import crc32c

from diloco_anywhere.bucket.format.framing import PREFIX, VERSION
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.format.record import RECORD_MAGIC, decode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import RunConfig
from diloco_anywhere.training.checkpoints.records import CheckpointCommit
from diloco_anywhere.training.checkpoints.writer import CheckpointPolicy, CheckpointWriter

RUN = RunLayout("run")


CONTRIBUTORS = ("a-0", "b-0", "c-0")


def counters_after(round_: int) -> dict[str, int]:
    """The manager's counters after round ``round_`` of a run that committed every round (two
    replicas): what a checkpoint of that round must hold."""
    return {"step": round_ + 1, "batches_committed": 2 * (round_ + 1), "sync": round_ + 1}


def diloco_like_state(seed: int = 0, round_: int = 3) -> dict:
    """What a replica checkpoints after round ``round_``: the manager's counters, and per
    fragment DiLoCo's global weights and outer optimizer (SGD with momentum, after one
    step)."""
    generator = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    for parameter in model.parameters():
        parameter.data = torch.randn(parameter.shape, generator=generator)
        parameter.grad = torch.randn(parameter.shape, generator=generator)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    outer.step()
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {
        "manager": counters_after(round_),
        "fragments": {
            "StreamingDiLoCoFragment_0": {
                "original_parameters": weights,
                "outer_optimizer": outer.state_dict(),
            }
        },
    }


def write_checkpoint(
    store: Store, round_: int, tree: dict, writers=CONTRIBUTORS, grace=30.0, trees=None,
    last=False,
):  # fmt: skip
    """Every writer in ``writers`` (of the sealed ``CONTRIBUTORS``) writes its share at once,
    each from ``tree`` unless ``trees`` gives it another, with the counters after ``round_``;
    ``last``: the run's last checkpoint, which every writer commits."""
    policy = CheckpointPolicy.of(RunConfig(), orphan_grace=grace, poll=0.02)
    trees = {
        name: (trees or {}).get(name, tree) | {"manager": counters_after(round_)}
        for name in writers
    }
    instances = {name: CheckpointWriter(store, RUN, name, policy) for name in writers}
    threads = [
        threading.Thread(
            target=writer.write,
            args=(round_, CONTRIBUTORS, trees[name]),
            kwargs={"last": last},
        )
        for name, writer in instances.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for writer in instances.values():
        writer.close()


def record_bytes(body: bytes) -> bytes:
    """A record holding ``body``, its checksum right: it reaches the reader's validation."""
    return PREFIX.pack(RECORD_MAGIC, VERSION, bytes(3), len(body), crc32c(body)) + body


def rewrite_counters(store: Store, layout: RunLayout, round_: int, **counters) -> str:
    """Give the committed checkpoint of ``round_`` other manager counters, in its state and in
    its COMMIT alike, with the COMMIT's sizes, CRC32Cs and fingerprint made right again (as
    another program writing the bucket could): a reader meets the values, not a checksum
    that fails. A counter given as None is dropped. The COMMIT's key."""
    key = layout.checkpoint_commit(round_)
    commit = decode_record(store.get(key), CheckpointCommit, key=key)
    nodes = dict(json.loads(store.get(commit.state.key))["dict"])
    manager = {name: node["value"] for name, node in nodes["manager"]["dict"]} | counters
    nodes["manager"] = {"dict": [[k, {"value": v}] for k, v in manager.items() if v is not None]}
    state = json.dumps({"dict": [[name, node] for name, node in nodes.items()]}).encode()
    fields = {k: counters[k] for k in ("step", "sync") if counters.get(k) is not None}
    body = json.loads(store.get(key)[PREFIX.size :]) | fields
    body["fingerprint"] = f"step-{fields.get('step', commit.step)}-{body['fingerprint'][-8:]}"
    body["state"] |= {"size": len(state), "crc32c": crc32c(state)}
    for name, data in ((commit.state.key, state), (key, record_bytes(json.dumps(body).encode()))):
        store.delete(name)
        store.put(name, data)
    return key
