"""``diloco bench data`` at a tiny size: every figure there, from a real prepare and a real
stream in a fresh interpreter (the numbers themselves are docs/benchmarks.md's)."""

from __future__ import annotations

import json

import pytest

from diloco_anywhere.bench.data import write_text
from support.runs import diloco

pytestmark = pytest.mark.integration  # it starts an interpreter


def test_the_data_bench_prepares_and_streams_each_size(tmp_path) -> None:
    result = diloco("bench", "data", "--sizes", "3MB,6MB", "--seq-len", "64", "--batch", "4",
                    "--batches", "5", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["sizes"]
    assert [row["text_bytes"] for row in rows] == [3_000_000, 6_000_000]
    for row in rows:
        assert row["tokens"] > 0.9 * row["text_bytes"]  # bytes: about a token a byte
        assert row["prepare_bytes_per_second"] > 0
        assert row["tokenizer_bytes_per_second"] > 0
        assert 0 < row["first_batch_seconds"] < 60
        assert row["peak_rss_bytes"] > 0
    assert rows[0]["peak_rss_over_smallest_bytes"] == 0


def test_the_synthetic_text_is_lines_of_json_none_alike(tmp_path) -> None:
    write_text(tmp_path, 2_000_000)
    lines = [line for path in sorted(tmp_path.iterdir()) for line in path.read_text().splitlines()]
    assert sum(len(line) + 1 for line in lines) >= 2_000_000
    assert len(set(lines)) == len(lines)
    assert all(isinstance(json.loads(line)["text"], str) for line in lines)
