"""One replica per output folder (``output_claims.py``): the first replica of a run to claim a
folder holds it; another replica of the run is refused naming both and the fix; a restart of
the holder, another run, and another folder are not. The Trainer's own claim at its setup is
in test_hf_trainer.py."""

from __future__ import annotations

import json
import re
import threading

import pytest

from diloco_anywhere.contract import EXIT_BAD_CONFIG
from diloco_anywhere.training.mistakes import (
    ScriptMistakeError,
    SharedOutputDirError,
    output_claims,
)
from diloco_anywhere.training.mistakes.output_claims import CLAIMS, claim_output_dir


def test_the_first_replica_holds_the_folder_and_the_second_is_refused_naming_both(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    claim = claim_output_dir(folder, "r", "local-0")
    assert claim == tmp_path.resolve() / CLAIMS / "out" / "r"
    assert not any(folder.iterdir())  # nothing inside: run_clm.py refuses a non-empty one
    assert json.loads(claim.read_text()) == {"run": "r", "replica": "local-0"}
    with pytest.raises(SharedOutputDirError) as refused:
        claim_output_dir(folder, "r", "local-1")
    message = str(refused.value)
    assert message.startswith(f"output_dir '{folder}' is replica local-0's: it claimed the folder")
    assert "this replica, local-1, was given it too" in message
    assert f'TrainingArguments(output_dir=os.path.join("{folder}", replica.replica_id))' in message
    assert f"`--output_dir {folder}/$DILOCO_REPLICA_ID`" in message
    assert json.loads(claim.read_text())["replica"] == "local-0"  # the first keeps it
    error = refused.value  # a script's mistake, never retried: exit 2, final (replica.py)
    assert isinstance(error, ScriptMistakeError)
    assert error.exit_code == EXIT_BAD_CONFIG


def test_another_path_to_the_same_folder_meets_the_same_claim(tmp_path, monkeypatch):
    (tmp_path / "out").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "out")
    monkeypatch.chdir(tmp_path)
    claim_output_dir("out", "r", "local-0")
    said = f"output_dir 'link/' ({tmp_path / 'out'}) is replica local-0's"  # the real folder
    with pytest.raises(SharedOutputDirError, match=re.escape(said)):
        claim_output_dir("link/", "r", "local-1")
    with pytest.raises(SharedOutputDirError) as refused:
        claim_output_dir(tmp_path / "out", "r", "local-1")
    assert f'output_dir=os.path.join("{tmp_path / "out"}", replica.replica_id)' in str(
        refused.value
    )


def test_a_restart_of_the_holder_takes_its_folder_again(tmp_path):
    first = claim_output_dir(tmp_path / "out", "r", "local-0")
    assert claim_output_dir(tmp_path / "out", "r", "local-0") == first


def test_other_folders_and_other_runs_are_free(tmp_path):
    claim_output_dir(tmp_path / "out" / "local-0", "r", "local-0")
    claim_output_dir(tmp_path / "out" / "local-1", "r", "local-1")  # its own: fine
    claim_output_dir(tmp_path / "out" / "local-0", "another", "local-1")  # a new run's
    with pytest.raises(SharedOutputDirError):  # each run's claim stands
        claim_output_dir(tmp_path / "out" / "local-0", "another", "local-0")


def test_a_claim_its_writer_never_finished_is_taken(tmp_path, monkeypatch):
    monkeypatch.setattr(output_claims, "SETTLE", 0.2)
    (tmp_path / CLAIMS / "out").mkdir(parents=True)
    (tmp_path / CLAIMS / "out" / "r").write_bytes(b"")  # created, then its writer died
    claim = claim_output_dir(tmp_path / "out", "r", "local-1")
    assert json.loads(claim.read_text())["replica"] == "local-1"
    with pytest.raises(SharedOutputDirError, match="is replica local-1's"):
        claim_output_dir(tmp_path / "out", "r", "local-0")


def test_of_replicas_claiming_together_exactly_one_holds_the_folder(tmp_path):
    replicas = [f"local-{k}" for k in range(8)]
    start, outcomes = threading.Barrier(len(replicas)), {}

    def claim(replica: str) -> None:
        start.wait()
        try:
            claim_output_dir(tmp_path / "out", "r", replica)
            outcomes[replica] = "holds"
        except SharedOutputDirError as refused:
            outcomes[replica] = str(refused)

    threads = [threading.Thread(target=claim, args=(replica,)) for replica in replicas]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    [holder] = [replica for replica, outcome in outcomes.items() if outcome == "holds"]
    assert all(
        outcome.startswith(f"output_dir '{tmp_path / 'out'}' is replica {holder}'s")
        for replica, outcome in outcomes.items()
        if replica != holder
    )
