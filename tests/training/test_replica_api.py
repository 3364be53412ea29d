"""What a script may read from its replica (docs/api.md): its data shard, the run's settings and
the inner steps the whole run trains, which a learning-rate schedule spans."""

from __future__ import annotations

from diloco_anywhere import join
from diloco_anywhere.config import RunConfig


def test_a_replica_knows_its_shard_and_how_many_inner_steps_the_run_trains(tmp_path):
    config = RunConfig.model_validate({
        "run": {"name": "api", "store": str(tmp_path / "store"), "replicas": 3},
        "diloco": {"sync_every": 6, "outer_steps": 5},
        "sync": {"grace": 0.5},  # alone of three, it waits out the grace on its vote
    })  # fmt: skip
    with join(config, replica_id="local-2") as replica:
        assert (replica.index, replica.total_steps) == (2, 30)
        assert replica.config.diloco.sync_every == 6
