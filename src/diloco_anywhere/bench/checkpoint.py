"""``diloco bench checkpoint``: the host memory and the time of writing, healing, exporting and
resuming a model of ``size`` bytes (P, its fp32 weights), against the raw store transfer of the
same bytes (issue 45).

The model is the issue's: Linear layers without bias, 8192 wide (256 MiB each; narrower below
1 GiB), trained by the public API (``join``, ``replica.diloco``) with int8 and one inner step a
round; the inner optimizer is AdamW, whose moments (2P) are the replica's own state. Every
operation runs in a fresh interpreter of its own (``spawn``: a forked one would share its
parent's pages), so its resident set is its own, sampled every 5 ms (``bench/tools/memory.py``):

- ``sync``: one round in the training loop, for comparison (torchft's pseudo-gradients and
  outer step included);
- ``write``: a checkpoint of the round just synced, written to the end;
- ``write_during_sync``: the same, started just before the next round, which runs meanwhile;
- ``heal`` and ``heal_replay``: a new replica's global state brought to the run's, from the
  newest checkpoint, and from an older one with ``replay`` rounds sealed after it;
- ``export``: ``diloco export`` of the newest checkpoint;
- ``resume``: a replica started again, as ``replica.diloco`` heals it and restores its own
  state (inner optimizer, generators).

A local store's files are read from the disk by every operation and by the raw get alike
(``uncached``: out of the page cache before each), not from whatever memory the operations
before left them in. Memory added is what the operation holds only while it runs: the peak
resident set during it less the larger of the sets before and after it (what a heal fills is
the replica's own state, which it holds after the heal too). The raw transfer is one ``put``
and one ``get`` of P bytes through the same store. Ratios are of one run: the machine is noisy.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import queue
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco_anywhere.bench.tools.memory import PeakMemory, resident_bytes

Progress = Callable[[str], None]
WIDTH = 8192  # the layers: Linear(8192, 8192), 256 MiB of fp32 each
OPERATIONS = ("sync", "write", "write_during_sync", "heal", "heal_replay", "export", "resume")


@dataclass(frozen=True)
class CheckpointBench:
    size: int  # P: bytes of the model's fp32 weights
    store: str  # the store URL (a local folder by default)
    replay: int = 3  # rounds sealed after the checkpoint a heal replays

    def shape(self) -> tuple[int, int]:
        """(layers, width): Linear(width, width) layers of about ``size`` bytes in all."""
        layer = 4 * WIDTH * WIDTH
        if self.size >= layer:
            return max(1, round(self.size / layer)), WIDTH
        return 4, max(8, math.isqrt(self.size // 16))

    def config(self, own_state: bool = True) -> Any:
        from diloco_anywhere.config import load_config, with_changes

        return with_changes(
            load_config(), run__name="checkpoint-bench", run__store=self.store, run__replicas=1,
            run__min_replicas=1, diloco__sync_every=1, diloco__outer_steps=1000,
            diloco__codec="int8", sync__grace=0.1, checkpoint__every=1000, checkpoint__keep=2,
            checkpoint__own_state=own_state, task__command=["python", "train.py"],
        )  # fmt: skip


def _model(bench: CheckpointBench) -> Any:
    import torch

    layers, width = bench.shape()
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))


def _measured(work: Callable[[], Any]) -> dict[str, float | None]:
    """``work()``'s seconds and the memory it held only while it ran (bytes)."""
    before = resident_bytes()
    started = time.perf_counter()
    with PeakMemory() as peak:
        work()
    seconds = time.perf_counter() - started
    after = resident_bytes()
    if None in (before, after, peak.bytes):
        return {"seconds": seconds, "added": None}
    return {"seconds": seconds, "added": float(peak.bytes - max(before, after))}  # type: ignore[arg-type,type-var]


def _train(bench: CheckpointBench, results: Any) -> None:
    """Round 0, then a round measured alone, a checkpoint written, one written while the next
    round runs, and ``replay`` rounds after it that a heal replays."""
    import torch

    from diloco_anywhere.training.replica import join

    model = _model(bench)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sample = torch.randn(1, bench.shape()[1])

    def step() -> None:
        model(sample).square().mean().backward()
        inner.step()
        inner.zero_grad(set_to_none=True)

    measured = {}
    with (
        join(bench.config(), replica_id="local-0") as replica,
        replica.diloco(model, inner) as training,
    ):
        step()  # round 0: its commit writes the run's first checkpoint
        training.checkpoints.writer.wait()  # type: ignore[union-attr]
        measured["sync"] = _measured(step)
        write = training.checkpoints.write_now
        writer = training.checkpoints.writer
        measured["write"] = _measured(lambda: (write(training.manager, training.state),
                                                   writer.wait()))  # fmt: skip
        measured["write_during_sync"] = _measured(
            lambda: (write(training.manager, training.state), step(), writer.wait())
        )
        for _ in range(bench.replay):
            step()
    results.put(measured)


def _heal(bench: CheckpointBench, results: Any, key: str, write_after: bool) -> None:
    """A new replica healed from the newest checkpoint (with ``write_after``, it then writes
    one of the round it healed to, for the next heal to load without replaying)."""
    import torch

    from diloco_anywhere.bucket.store import Store
    from diloco_anywhere.collective.allreduce import BucketCollective
    from diloco_anywhere.training.builders import build_parts
    from diloco_anywhere.training.recovery.healing import heal

    config = bench.config(own_state=False)
    model = _model(bench)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    store = Store(config.store_url())
    name = f"healer-{key}"
    collective = BucketCollective(store, config.run.name, name, config.collective_config())
    parts = build_parts(config, collective, model, inner, 1)
    with parts.diloco():
        state = parts.global_state()
        measured = _measured(lambda: heal(collective, state, parts.manager, 1, from_initial=False))
        if write_after:
            from diloco_anywhere.training.ranks.replica_group import ReplicaGroup
            from diloco_anywhere.training.recovery.after_sync import GlobalCheckpoints

            checkpoints = GlobalCheckpoints(config, collective, ReplicaGroup(), lambda _: None)
            checkpoints.write_now(parts.manager, state)
            checkpoints.close()
    collective.close()
    results.put({key: measured})


def _export(bench: CheckpointBench, results: Any, destination: str) -> None:
    from diloco_anywhere.launching.watch.export import export

    results.put({"export": _measured(lambda: export(bench.config(), destination))})


def _resume(bench: CheckpointBench, results: Any) -> None:
    """The replica started again: ``replica.diloco`` heals it and restores its own state."""
    import torch

    from diloco_anywhere.training.replica import join

    model = _model(bench)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with join(bench.config(), replica_id="local-0") as replica:
        entered = replica.diloco(model, inner)
        measured = _measured(entered.__enter__)
        entered.__exit__(None, None, None)
    results.put({"resume": measured})


def _raw(bench: CheckpointBench, results: Any) -> None:
    """One put and one get of P bytes through the store (the get from the disk, for a local
    store: ``uncached``)."""
    from diloco_anywhere.bucket.store import Store

    store, data = Store(bench.store), os.urandom(1 << 20) * (bench.size >> 20)
    started = time.perf_counter()
    store.put("raw/object", data)
    written = time.perf_counter() - started
    del data
    uncached(bench.store)
    started = time.perf_counter()
    store.get("raw/object")
    results.put({"raw": {"write_seconds": written, "read_seconds": time.perf_counter() - started}})
    store.delete("raw/object")


def uncached(store: str) -> None:
    """A local store's files out of the page cache (written to disk first), so that every
    operation and the raw get read them from the disk alike, whatever the operations before
    them left in memory; nothing for another store."""
    if "://" in store and not store.startswith("file://"):
        return
    for path in Path(store.removeprefix("file://")).rglob("*"):
        if path.is_file():
            descriptor = os.open(path, os.O_RDONLY)
            try:
                os.fsync(descriptor)
                os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(descriptor)


def _in_a_process(target: Callable[..., None], bench: CheckpointBench, *args: Any) -> dict:
    """``target(bench, results, *args)`` in a fresh interpreter; what it put in ``results``,
    or the error it ended with (it printed its traceback)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=target, args=(bench, results, *args))
    process.start()
    while True:
        try:
            found = results.get(timeout=1.0)
            break
        except queue.Empty:
            if not process.is_alive():
                name, code = target.__name__.strip("_"), process.exitcode
                raise RuntimeError(
                    f"the {name} process exited {code} without its measures"
                ) from None
    process.join(600)
    return found


def bench_checkpoint(bench: CheckpointBench, progress: Progress) -> dict[str, Any]:
    """Every operation of ``OPERATIONS``, each in a process of its own, and the raw transfer;
    memory as x P, time as x the raw write (writes) or read (the others)."""
    found: dict[str, Any] = {}
    beside = Path(bench.store).parent if "://" not in bench.store else None  # a local store's
    if beside is not None:
        beside.mkdir(parents=True, exist_ok=True)
    export_folder = Path(tempfile.mkdtemp(prefix="diloco-bench-export-", dir=beside))
    try:
        steps = [
            ("raw transfer", _raw, ()),
            ("training: a round, a checkpoint, one during a round", _train, ()),
            (f"heal replaying {bench.replay} rounds", _heal, ("heal_replay", True)),
            ("heal", _heal, ("heal", False)),
            ("export", _export, (str(export_folder / "model"),)),
            ("resume", _resume, ()),
        ]
        for label, target, args in steps:
            progress(label)
            uncached(bench.store)
            found.update(_in_a_process(target, bench, *args))
    finally:
        shutil.rmtree(export_folder, ignore_errors=True)
    return _ratios(bench, found)


def _moved_bytes(bench: CheckpointBench) -> dict[str, tuple[int, int]]:
    """What each operation must move at the least, (bytes got, bytes put): a checkpoint is
    the global weights and the outer momentum (2P), a replica's own state AdamW's two
    moments (2P), a replayed round one int8 contribution (P/4), an export the weights (P)."""
    checkpoint, own, round_ = 2 * bench.size, 2 * bench.size, bench.size // 4
    return {
        "write": (0, checkpoint), "write_during_sync": (0, checkpoint), "heal": (checkpoint, 0),
        "heal_replay": (checkpoint + bench.replay * round_, 0),
        "export": (bench.size, bench.size), "resume": (checkpoint + own, 0),
    }  # fmt: skip


def _ratios(bench: CheckpointBench, found: dict[str, Any]) -> dict[str, Any]:
    """Each operation's memory as x P and its time (a write during a round: both beyond the
    round's own, measured alone) against the raw transfer of the bytes it moves
    (``_moved_bytes``, at the speed of the raw put and get of P bytes)."""
    raw = found.pop("raw")
    put, get = raw["write_seconds"] / bench.size, raw["read_seconds"] / bench.size
    rows = {}
    for name in OPERATIONS:
        measured = found[name]
        added, seconds = measured["added"], measured["seconds"]
        if name == "write_during_sync":  # what the write adds to the round it overlaps
            seconds = max(0.0, seconds - found["sync"]["seconds"])
            if added is not None and found["sync"]["added"] is not None:
                added = max(0.0, added - found["sync"]["added"])
        got, sent = _moved_bytes(bench).get(name, (0, 0))
        raw_seconds = got * get + sent * put
        rows[name] = {
            "seconds": seconds,
            "memory_added_bytes": added,
            "memory_added_vs_p": None if added is None else added / bench.size,
            "raw_seconds": raw_seconds or None,
            "seconds_vs_raw": seconds / raw_seconds if raw_seconds else None,
        }
    return {"size": bench.size, "store": bench.store, "replay": bench.replay, "raw": raw,
            "operations": rows}  # fmt: skip
