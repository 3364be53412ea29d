"""``diloco bench checkpoint`` at a tiny size: every operation measured in a process of its own
(the numbers themselves are docs/benchmarks.md's, at 1 GiB)."""

from __future__ import annotations

import json

import pytest

from diloco_anywhere.bench.checkpoint import OPERATIONS, CheckpointBench
from support.runs import diloco

pytestmark = pytest.mark.integration  # it starts interpreters


def test_the_checkpoint_bench_measures_every_operation_against_the_raw_transfer(tmp_path):
    result = diloco("bench", "checkpoint", "--size", "4MiB", "--replay", "2",
                    "--store", str(tmp_path / "store"), "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)
    assert found["size"] == 4 << 20
    assert found["raw"]["write_seconds"] > 0
    assert found["raw"]["read_seconds"] > 0
    rows = found["operations"]
    assert list(rows) == list(OPERATIONS)
    for name, row in rows.items():
        assert row["seconds"] > 0 or name == "write_during_sync", name  # beyond its round
        assert row["memory_added_vs_p"] is not None, name
        assert row["memory_added_vs_p"] >= 0, name
        assert (row["seconds_vs_raw"] is None) == (name == "sync"), name
    assert not list((tmp_path / "store").glob("**/.tmp-*"))  # every spool file was removed


def test_the_model_is_the_issues_layers_at_a_gib_and_narrower_below():
    assert CheckpointBench(1 << 30, "store").shape() == (4, 8192)
    assert CheckpointBench(4 << 30, "store").shape() == (16, 8192)
    layers, width = CheckpointBench(4 << 20, "store").shape()
    assert layers * width * width * 4 == pytest.approx(4 << 20, rel=0.01)
