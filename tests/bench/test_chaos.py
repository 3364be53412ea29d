"""Chaos, kept short: replicas SIGKILLed mid-run and restarted by the launcher.

The run must finish, every round's committing replicas must agree on the global state they
started from, and every restarted replica must heal from the bucket. The longer version, with
the loss against a fault-free run and the goodput, is ``diloco bench chaos``
(docs/benchmarks.md).
"""

from __future__ import annotations

import pytest

from diloco_anywhere.bench.chaos import (
    chaos_figures,
    final_evaluations,
    fingerprint_disagreements,
    run_with_chaos,
    unhealed_restarts,
)
from diloco_anywhere.bench.train import bench_config

pytestmark = pytest.mark.integration  # every test here starts processes

ROUNDS = 24


def test_a_run_survives_replicas_killed_and_restarted(tmp_path) -> None:
    config = bench_config(
        run__name="chaos", run__replicas=3, run__min_replicas=2, diloco__sync_every=10,
        diloco__outer_steps=ROUNDS, diloco__codec="fp32", checkpoint__every=3,
        sync__grace=2.0, sync__lease_period=1.0, sync__timeout=60.0, task__log_every=5,
        task__eval_every=ROUNDS,
        task__options={"preset": "tiny", "batch_size": 4, "corpus_bytes": 300_000},
    )  # fmt: skip
    run = run_with_chaos(config, tmp_path, kills=3, kill_every=3, seed=0, progress=print)
    figures = chaos_figures(run, config)
    assert figures["kills"] == figures["restarts"] == 3
    assert figures["done"] == ["local-0", "local-1", "local-2"]
    assert figures["rounds"] == ROUNDS
    assert fingerprint_disagreements(run.metrics) == {}
    assert unhealed_restarts(run.metrics) == []
    # Every kill came back and healed (above). Whether a replica killed late trains again
    # before the run ends is a race between its restart and the survivors' rounds (a loaded
    # machine lost it once, after round 9 of 24): asserted for the first kill only, which
    # leaves 20 rounds; `diloco bench chaos` measures each kill's time to rejoin.
    first = run.kills[0]
    syncs = run.metrics[first.replica].syncs
    assert any(sync.round > first.after_round + 1 and sync.contributed for sync in syncs)
    # one global state at the end: the same held-out loss on every replica that evaluated it
    evaluations = final_evaluations(run.metrics)
    assert evaluations
    assert len(set(evaluations.values())) == 1
    assert 0.3 < figures["goodput"] <= 1.0
