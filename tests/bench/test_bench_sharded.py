"""``diloco bench sharded``: each rank of a sharded replica moves its 1/N of the bytes."""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from diloco_anywhere.bench.sharded import _fill, _mean_error
from diloco_anywhere.cli import app
from diloco_anywhere.cli.bench.sync import _sharded_table

runner = CliRunner()
SIZE = 1 << 20


@pytest.mark.integration
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


@pytest.mark.integration
def test_every_rank_through_its_own_shaped_link_cannot_beat_that_link():
    """Each rank reaches moto through a link of its own; the busiest rank's bytes cross its
    link within the round, so the round takes at least their time at the link's rate."""
    result = runner.invoke(app, ["bench", "sharded", "--ranks", "1,2", "--replicas", "2",
                                 "--size", "512KiB", "--rounds", "1", "--standin", "s3",
                                 "--bandwidth", "2MB", "--latency", "0.01", "--link", "2MB",
                                 "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["wan"] == {"bandwidth": 2_000_000, "latency": 0.01, "link": 2_000_000}
    one, two = report["configs"]
    for row in (one, two):
        for direction in ("up", "down"):
            assert row[f"bytes_{direction}_per_rank_mean"] >= row["shard_bytes"]
            assert row[f"bytes_{direction}_per_rank_max"] < 1.1 * row["shard_bytes"] + 16_384
        assert row["max_mean_error"] < 1e-5
        assert row["link_bound_seconds"] == pytest.approx(row["busiest_host_bytes"] / 2e6)
        assert row["round_vs_link_bound"] == pytest.approx(
            row["round_seconds"] / row["link_bound_seconds"]
        )
        assert row["round_seconds"] >= 0.8 * row["link_bound_seconds"]
    assert abs(two["busiest_host_vs_baseline"] - 0.5) < 0.05
    assert two["link_bound_seconds"] < one["link_bound_seconds"]
    assert one["round_vs_baseline"] == 1
    assert two["round_vs_baseline"] == pytest.approx(two["round_seconds"] / one["round_seconds"])

    console = Console(record=True, width=250)
    console.print(_sharded_table(report))
    table = console.export_text()
    for heading in ("round s (vs N=1)", "link bound s", "round / bound"):
        assert heading in table


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
