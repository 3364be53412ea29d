"""One replica per output folder: the folder a script writes its own outputs to (a Hugging Face
Trainer's ``output_dir``: its checkpoints, its saved model) is claimed by the first replica of
the run to write there, and any other replica of the run given it too is refused at once.

Local replicas all run in run.toml's folder (``[task] command``, backends/local.py), and
Kubernetes pods may share a volume, so ``output_dir="out"`` in every replica is one folder.
Two Trainers saving there overwrite each other's checkpoints, and a restart (or a script that
resumes from ``get_last_checkpoint(output_dir)``, as transformers' ``run_clm.py`` does) resumes
from the other replica's. Nothing else reports it: the run's own checkpoints are in the bucket.

The claim is ``.diloco-claims/<folder's name>/<run>`` beside the folder (in its parent),
created exclusively (``O_CREAT | O_EXCL``, which local disks and NFS volumes honour), holding
the claiming replica's id: of two replicas that start together exactly one creates it, and the
other reads who did. A restart of the same replica id finds its own claim and goes on; a claim
of another run (the folder used again for a new run) is a file of its own, so it neither
blocks this run nor needs taking over. The folder's path is resolved first, so two paths to
one folder (relative, absolute, a symbolic link) meet at the same claim. Nothing is written
inside the folder: scripts such as transformers' ``run_clm.py`` refuse a non-empty
``output_dir`` that holds no checkpoint, which a restart before the first one would be.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from diloco_anywhere.training.mistakes import SharedOutputDirError

CLAIMS = ".diloco-claims"  # beside a claimed folder: one folder of claims per folder name
SETTLE = 2.0  # seconds a claim just created may take to hold its writer's id
POLL = 0.05


def claim_output_dir(folder: str | os.PathLike[str], run: str, replica_id: str) -> Path:
    """Claim ``folder`` for replica ``replica_id`` of run ``run`` (created if missing); the
    claim's path. ``SharedOutputDirError`` naming the folder, both ids and the fix if another
    replica of the run claimed it first."""
    claim = claim_path(folder, run)
    claim.parent.mkdir(parents=True, exist_ok=True)
    mine = json.dumps({"run": run, "replica": replica_id}).encode()
    try:
        descriptor = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        descriptor = None
    if descriptor is not None:
        try:
            os.write(descriptor, mine)  # one write of a few bytes: read whole or not at all
        finally:
            os.close(descriptor)
        return claim
    holder = _holder(claim)
    if holder is None:  # its writer ended between creating and writing it: no one's
        _replace(claim, mine)
    elif holder != replica_id:
        raise SharedOutputDirError(_refusal(str(folder), claim, run, holder, replica_id))
    return claim  # this replica's own, from an earlier start: a restart


def claim_path(folder: str | os.PathLike[str], run: str) -> Path:
    """Where run ``run``'s claim of ``folder`` is: beside it, whatever path names it."""
    resolved = Path(folder).resolve()
    return resolved.parent / CLAIMS / resolved.name / run


def _holder(claim: Path) -> str | None:
    """The replica id a claim holds; ``None`` if it still holds none after ``SETTLE`` seconds
    (a claim is read empty between its writer's create and write)."""
    deadline = time.monotonic() + SETTLE
    while True:
        try:
            replica = json.loads(claim.read_bytes()).get("replica")
        except (ValueError, AttributeError, FileNotFoundError):
            replica = None
        if isinstance(replica, str) and replica:
            return replica
        if time.monotonic() > deadline:
            return None
        time.sleep(POLL)


def _replace(claim: Path, data: bytes) -> None:
    staged = claim.with_name(f"{claim.name}.{os.getpid()}.tmp")
    staged.write_bytes(data)
    os.replace(staged, claim)


def _refusal(given: str, claim: Path, run: str, holder: str, me: str) -> str:
    folder, base = Path(given).resolve(), given.rstrip("/") or given
    where = "" if str(folder) == base else f" ({folder})"
    return (
        f"output_dir {given!r}{where} is replica {holder}'s: it claimed the folder for run "
        f"{run!r} first ({claim}), and this replica, {me}, was given it too. Two replicas "
        f"saving to one folder overwrite each other's checkpoints, and a restart resumes from "
        f"the other's (local replicas all run in run.toml's folder; pods may share a volume). "
        "Give each replica its own: "
        f'TrainingArguments(output_dir=os.path.join("{base}", replica.replica_id)), or in '
        f"[task] command "
        f"`--output_dir {base}/$DILOCO_REPLICA_ID`; or "
        'save_strategy="no" '
        f"(the run's checkpoints are in the bucket). If {holder} is no longer a replica of this "
        f"run, delete {claim}"
    )
