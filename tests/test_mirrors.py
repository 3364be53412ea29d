"""Checkpoint mirrors: every committed checkpoint reaches each mirror intact (its COMMIT last),
and a mirror that fails is reported in the run's status without holding training back."""

from __future__ import annotations

from rich.console import Console

from diloco_anywhere.checkpoint import committed_rounds, load_checkpoint
from diloco_anywhere.cli.run import _status_table
from diloco_anywhere.config import load_config
from diloco_anywhere.layout import RunLayout
from diloco_anywhere.status import ReplicaStatus
from diloco_anywhere.store import Store
from test_launch import RUN_TOML, diloco, statuses

RUN = RunLayout("t")


def _launch(tmp_path, monkeypatch, mirrors: list[str]) -> None:
    monkeypatch.chdir(tmp_path)
    text = RUN_TOML.format(replicas=2, outer_steps=3)
    checkpoint = f"\n[checkpoint]\nevery = 1\nkeep = 2\nmirrors = {mirrors!r}\n".replace("'", '"')
    (tmp_path / "run.toml").write_text(text + checkpoint)
    result = diloco("launch", "--config", "run.toml")
    assert result.exit_code == 0, result.output


def test_every_committed_checkpoint_reaches_the_mirror_intact(tmp_path, monkeypatch):
    _launch(tmp_path, monkeypatch, ["mirror"])  # relative: next to run.toml, as run.store
    config = load_config(tmp_path / "run.toml")
    primary, mirror = Store(config.store_url()), Store(str(tmp_path / "mirror"))
    rounds = committed_rounds(primary, RUN)
    assert len(rounds) == 2  # keep = 2: the mirror is pruned alike
    assert committed_rounds(mirror, RUN) == rounds
    for round_ in rounds:
        copied, original = (
            load_checkpoint(mirror, RUN, round_),
            load_checkpoint(primary, RUN, round_),
        )
        assert copied.commit == original.commit  # same sizes and checksums of the same objects
    assert all(row["mirror_failures"] == 0 for row in statuses("run.toml").values())


def test_a_failing_mirror_is_reported_and_training_goes_on(tmp_path, monkeypatch):
    (tmp_path / "not-a-folder").write_text("a file where the mirror's folder would be")
    _launch(tmp_path, monkeypatch, [str(tmp_path / "not-a-folder" / "mirror")])
    rows = statuses("run.toml")
    assert {(row["state"], row["outer_step"]) for row in rows.values()} == {("done", 3)}
    assert sum(row["mirror_failures"] for row in rows.values()) >= 1
    console = Console(width=200, record=True)
    console.print(_status_table([ReplicaStatus(**row) for row in rows.values()], "t"))
    assert "mirror failed" in console.export_text()
