"""``diloco report --tensorboard DIR --wandb PROJECT``: the run's metrics from its bucket in
TensorBoard (read back with TensorBoard's own reader) and W&B (offline, read back from the
run files W&B wrote), each replica a run of one group."""

from __future__ import annotations

import json
import struct
import sys

import pytest

from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.training.records.metrics import MetricsWriter, StepLine, SyncLine
from support.runs import diloco

REPLICAS = ("local-0", "local-1")


def _sync(tokens: int, eval_loss: float | None) -> SyncLine:
    return SyncLine(
        outer_step=tokens // 100, committed=True, participants=2, eval_loss=eval_loss,
        tokens=tokens, tokens_per_second=50.0, sync_exposed_seconds=0.5, bytes_up=1000,
        bytes_down=2000, time=1.0,
    )  # fmt: skip


@pytest.fixture
def run_with_metrics(tmp_path, monkeypatch):
    """A run.toml whose store holds two replicas' metrics: loss and lr per step, two syncs."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text('[run]\nname = "tracked"\nstore = "store"\n')
    store, layout = Store(str(tmp_path / "store")), RunLayout("tracked")
    for k, replica in enumerate(REPLICAS):
        writer = MetricsWriter(store, layout, replica, 0, "local")
        for step in range(1, 5):
            loss = 4.0 - step / 2 + k
            line = StepLine(step=step, loss=loss, tokens=50 * step, time=1.0, values={"lr": 0.1})
            writer.add(line)
        writer.add(_sync(100, None))
        writer.add(_sync(200, 2.5))
        writer.flush()
    return tmp_path


def test_tensorboard_gets_one_run_per_replica(run_with_metrics):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = diloco("report", "--config", "run.toml", "--tensorboard", "tb")
    assert result.exit_code == 0, result.output
    for k, replica in enumerate(REPLICAS):
        events = EventAccumulator(str(run_with_metrics / "tb" / replica))
        events.Reload()
        loss = [(e.step, e.value) for e in events.Scalars("loss")]
        assert loss == [(50, 3.5 + k), (100, 3.0 + k), (150, 2.5 + k), (200, 2.0 + k)]
        assert [(e.step, e.value) for e in events.Scalars("eval_loss")] == [(200, 2.5)]
        assert [e.value for e in events.Scalars("lr")] == pytest.approx([0.1] * 4)
        assert [e.step for e in events.Scalars("bytes_up")] == [100, 200]


def _wandb_records(path) -> list[bytes]:
    """The records of a W&B run file: a 7-byte header (``:W&B``, magic, version), then
    LevelDB's log format (32 KiB blocks; each piece a masked CRC32C, a length and a type:
    1 whole, 2 first, 3 middle, 4 last), each record a ``wandb_internal_pb2.Record``."""
    data, block = path.read_bytes(), 32 * 1024
    assert data[:4] == b":W&B"
    records, pending, offset = [], b"", 7
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # a block's tail too short for a header: padding
            offset += block - offset % block
            continue
        length, kind = struct.unpack_from("<HB", data, offset + 4)
        pending += data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records


@pytest.mark.integration
def test_wandb_gets_one_run_per_replica_in_the_run_s_group(run_with_metrics, monkeypatch):
    from wandb.proto import wandb_internal_pb2

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(run_with_metrics))
    monkeypatch.setenv("WANDB_SILENT", "true")
    result = diloco("report", "--config", "run.toml", "--wandb", "diloco-tests")
    assert result.exit_code == 0, result.output
    for k, replica in enumerate(REPLICAS):
        [path] = run_with_metrics.glob(f"wandb/offline-run-*-tracked-{replica}/run-*.wandb")
        group, history = None, []
        for data in _wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "run":
                group = record.run.run_group
            if record.WhichOneof("record_type") == "history":
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
                history.append(items)
        assert group == "tracked"
        losses = [(row["_step"], row["loss"]) for row in history if "loss" in row]
        assert losses == [(50, 3.5 + k), (100, 3.0 + k), (150, 2.5 + k), (200, 2.0 + k)]
        assert [row["eval_loss"] for row in history if "eval_loss" in row] == [2.5]


def test_a_tracker_that_is_not_installed_says_which_extra_installs_it(
    run_with_metrics, monkeypatch
):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    result = diloco("report", "--config", "run.toml", "--wandb", "p")
    assert result.exit_code == 1
    assert "pip install 'diloco-anywhere[wandb]'" in result.output
