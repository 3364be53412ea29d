"""``diloco bench sharded``: each rank of a sharded replica moves its 1/N of the bytes."""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from diloco_anywhere.bench.sharded import _fill, _mean_error
from diloco_anywhere.cli import app
from diloco_anywhere.cli.bench import _sharded_table

runner = CliRunner()
SIZE = 1 << 20


def test_two_ranks_each_move_half_of_what_one_rank_moves_and_get_the_mean(tmp_path):
    store = tmp_path / "store"
    result = runner.invoke(app, ["bench", "sharded", "--ranks", "2,1", "--replicas", "2",
                                 "--size", "1MiB", "--rounds", "1", "--store", str(store),
                                 "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["replicas"], report["size_bytes"], report["baseline_ranks"]) == (2, SIZE, 1)
    one, two = report["configs"]  # fewest ranks first, whatever order they were given in
    assert (one["ranks"], two["ranks"]) == (1, 2)
    assert two["shard_bytes"] == SIZE // 2
    for row in (one, two):
        # a round is the shard up and the other replica's down, plus records, polls, leases
        for direction in ("up", "down"):
            assert row[f"bytes_{direction}_per_rank_mean"] >= row["shard_bytes"]
            assert row[f"bytes_{direction}_per_rank_max"] < 1.1 * row["shard_bytes"] + 16_384
        busiest = row["busiest_host_bytes"]
        assert row["bytes_per_rank_mean"] <= busiest
        assert busiest <= row["bytes_up_per_rank_max"] + row["bytes_down_per_rank_max"]
        assert row["max_mean_error"] < 1e-5  # every rank got its shard's mean
        assert row["round_seconds"] > 0
    assert abs(two["bytes_per_rank_vs_baseline"] - 0.5) < 0.05
    assert abs(two["busiest_host_vs_baseline"] - 0.5) < 0.05
    assert two["expected_vs_baseline"] == 0.5
    # a replica's ranks together move what one unsharded rank moves
    assert abs(two["bytes_per_replica_max"] / one["bytes_per_replica_max"] - 1) < 0.05
    assert list(store.iterdir()) == []  # each rank count's rounds are deleted after it

    console = Console(record=True, width=200)
    console.print(_sharded_table(report))
    table = console.export_text()
    for heading in ("ranks N", "up / rank (mean, max)", "busiest host", "vs N=1", "round s"):
        assert heading in table
    assert "(0.500)" in table


def test_the_mean_check_tells_a_replica_s_own_values_and_another_shard_from_the_mean():
    own = torch.empty(4096)
    _fill(own, first=4096, round_=3, offset=0)  # replica 0's contribution, never averaged
    assert _mean_error(own, 4096, 3, replicas=2) == pytest.approx(0.5)
    mean = torch.empty(4096)
    _fill(mean, first=0, round_=3, offset=0.5)  # the mean, of rank 0's shard
    assert _mean_error(mean, 0, 3, replicas=2) == 0
    assert _mean_error(mean, 4096, 3, replicas=2) > 0.1  # read as rank 1's


def test_ranks_must_be_counts():
    result = runner.invoke(app, ["bench", "sharded", "--ranks", "1,two"])
    assert result.exit_code == 2
    assert "give rank counts from 1 to 64, e.g. 1,2,4" in result.output
