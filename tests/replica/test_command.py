"""``[task] command``: the replica entrypoint runs any script as the replica, and a script
that does not take part in the run fails its replica with a message, never leaving it hanging.
The script that trains (docs/api.md) is run through ``diloco launch`` in test_api_docs.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.contract import EXIT_NOT_SYNCING
from diloco_anywhere.training.records.metrics import MetricsReader

pytestmark = pytest.mark.integration  # every test here starts processes

RUN_TOML = """
[run]
name = "c"
store = "store"
replicas = 1
[task]
command = {command}
join_timeout = {join_timeout}
"""


def _entrypoint(
    tmp_path, script: str, join_timeout: float = 600.0, arguments: tuple[str, ...] = ()
) -> subprocess.Popen:
    (tmp_path / "script.py").write_text(script)
    command = json.dumps(["python", "script.py", *arguments])
    (tmp_path / "run.toml").write_text(RUN_TOML.format(command=command, join_timeout=join_timeout))
    return subprocess.Popen(
        [sys.executable, "-m", "diloco_anywhere.replica", "--config", str(tmp_path / "run.toml"),
         "--replica-id", "local-0"],
        cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # a process group, as the local backend starts replicas
    )  # fmt: skip


def _events(tmp_path) -> list:
    return MetricsReader(Store(str(tmp_path / "store")), RunLayout("c")).read()["local-0"].events


def _ended(process: subprocess.Popen) -> tuple[int, str]:
    _, stderr = process.communicate(timeout=120)
    return process.returncode, stderr


def test_the_script_runs_in_run_toml_s_folder_with_the_replica_s_identity(tmp_path):
    """In its environment, and in its arguments (no shell runs the command): what a script
    names per replica, e.g. its ``--output_dir`` in the folder every local replica shares."""
    script = (
        "import json, os, pathlib, sys\n"
        "keys = ['DILOCO_REPLICA_ID', 'DILOCO_REPLICA_INDEX', 'DILOCO_PLATFORM', 'DILOCO_CONFIG']\n"
        "pathlib.Path('seen.json').write_text(json.dumps({k: os.environ[k] for k in keys}))\n"
        "pathlib.Path('argv.json').write_text(json.dumps(sys.argv[1:]))\n"
    )
    arguments = (
        "--output_dir",
        "out/$DILOCO_REPLICA_ID",
        "${DILOCO_REPLICA_INDEX}-$DILOCO_PLATFORM",
        "$DILOCO_REPLICA_IDS",
        "$HOME",
    )
    code, stderr = _ended(_entrypoint(tmp_path, script, arguments=arguments))
    assert code == 1
    assert "never called diloco_anywhere.join()" in stderr
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {
        "DILOCO_REPLICA_ID": "local-0",
        "DILOCO_REPLICA_INDEX": "0",
        "DILOCO_PLATFORM": "local",
        "DILOCO_CONFIG": str(tmp_path / "run.toml"),
    }
    argv = json.loads((tmp_path / "argv.json").read_text())  # other names stay as written
    assert argv == ["--output_dir", "out/local-0", "0-local", "$DILOCO_REPLICA_IDS", "$HOME"]


def test_a_script_that_never_joins_is_stopped_after_the_join_timeout(tmp_path):
    started = time.monotonic()
    code, stderr = _ended(_entrypoint(tmp_path, "import time\ntime.sleep(600)\n", join_timeout=2))
    assert code == 1
    assert "did not call diloco_anywhere.join() within 2 s (task.join_timeout)" in stderr
    assert time.monotonic() - started < 60  # stopped, not waited for


def test_a_script_that_joins_then_exits_before_training_fails_its_replica(tmp_path):
    script = "import diloco_anywhere\nwith diloco_anywhere.join():\n    pass\n"
    code, stderr = _ended(_entrypoint(tmp_path, script))
    assert code == 1
    assert "exited 0 before the run's outer steps were trained (it joined)" in stderr


def test_a_script_that_leaves_training_early_is_recorded_as_failed(tmp_path):
    """sys.exit(0) before the run's outer steps: the script's replica says how far it got."""
    script = (
        "import sys, torch\nimport diloco_anywhere\n"
        "with diloco_anywhere.join() as replica:\n"
        "    model = torch.nn.Linear(2, 1)\n"
        "    inner = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    with replica.diloco(model, inner):\n"
        "        pass\n"
        "    sys.exit(0)\n"
    )
    code, stderr = _ended(_entrypoint(tmp_path, script))
    assert code == 1
    assert "exited 0 before the run's outer steps were trained (it joined)" in stderr
    events = [(event.event, event.detail) for event in _events(tmp_path)]
    assert events[-1] == ("failed", "left training at outer step 0 of 10")


def test_a_failing_script_fails_its_replica_with_its_own_exit_code_and_error(tmp_path):
    script = "import diloco_anywhere\nwith diloco_anywhere.join():\n    raise SystemExit(3)\n"
    code, _ = _ended(_entrypoint(tmp_path, script))
    assert code == 3
    assert [(event.event, event.detail) for event in _events(tmp_path)] == [
        ("failed", "SystemExit: 3")
    ]


def test_a_stop_reaches_the_script_and_is_recorded(tmp_path):
    script = (
        "import pathlib, time\nimport diloco_anywhere\n"
        "with diloco_anywhere.join():\n"
        "    pathlib.Path('joined').touch()\n"
        "    time.sleep(600)\n"
    )
    process = _entrypoint(tmp_path, script)
    deadline = time.monotonic() + 120
    while not (tmp_path / "joined").exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGTERM)  # as `diloco stop` does: the script gets it twice
    code, _ = _ended(process)
    assert code == 143
    assert [event.event for event in _events(tmp_path)] == ["stopped"]


STEPS_ANOTHER_OPTIMIZER = """
import torch
import diloco_anywhere

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
wrapped = torch.optim.SGD(model.parameters(), lr=0.1)
other = torch.optim.SGD(model.parameters(), lr=0.1)  # the mistake: this one is stepped


def data(start):
    while True:
        yield torch.randn(8, 4)


with diloco_anywhere.join() as replica:
    with replica.diloco(model, wrapped) as training:
        for x in training.batches(data):
            model(x).pow(2).mean().backward()
            other.step()
            other.zero_grad()
"""


# The same mistake in the explicit form (docs/api.md): no `with`, no `finish` either, so the
# error reaches Python's excepthook, which records it and exits with the mistake's own code.
STEPS_ANOTHER_OPTIMIZER_STARTED = (
    STEPS_ANOTHER_OPTIMIZER.split("with diloco_anywhere")[0]
    + """
replica = diloco_anywhere.join()
training = replica.start(model, wrapped)
for step in training.steps():
    model(torch.randn(8, 4)).pow(2).mean().backward()
    other.step()
    other.zero_grad()
"""
)


@pytest.mark.parametrize("script", [STEPS_ANOTHER_OPTIMIZER, STEPS_ANOTHER_OPTIMIZER_STARTED])
def test_a_script_that_steps_another_optimizer_stops_at_once_naming_the_fix(tmp_path, script):
    """It would otherwise train forever at outer step 0 (state `running`, no warning)."""
    code, stderr = _ended(_entrypoint(tmp_path, script))
    fix = "took no step: call step() on that same optimizer (DiLoCo syncs inside it)"
    assert code == EXIT_NOT_SYNCING, stderr
    assert fix in stderr
    [(event, detail)] = [(e.event, e.detail) for e in _events(tmp_path) if e.event != "started"]
    assert event == "failed"
    assert detail.startswith("NotSyncingError: 200 turns of training.batches (or training."
                             "steps) since inner step 0")  # fmt: skip
    assert fix in detail


STARTED = """
import sys
import torch
import diloco_anywhere

torch.manual_seed(0)
model = torch.nn.Linear(2, 1)
inner = torch.optim.SGD(model.parameters(), lr=0.1)
replica = diloco_anywhere.join()
training = replica.start(model, inner)
for step in training.steps():
    model(torch.ones(4, 2)).pow(2).mean().backward()
    inner.step()
    inner.zero_grad()
    {body}
"""


@pytest.mark.parametrize(
    ("body", "code", "ending"),
    [
        ("pass", 0, ("done", "10 outer steps, 500 tokens, eval loss None")),
        ("if step == 3: raise ValueError('bad batch')", 1, ("failed", "ValueError: bad batch")),
        ("if step == 3: sys.exit(0)", 1, ("failed", "left training at outer step 0 of 10")),
    ],
    ids=["trained", "raised", "left-early"],
)  # fmt: skip
def test_a_started_replica_that_never_finishes_has_its_end_recorded(tmp_path, body, code, ending):
    """``replica.start`` without ``replica.finish``: the end is recorded all the same, at exit
    or from the uncaught error, and the process neither hangs nor loses the error."""
    returned, stderr = _ended(_entrypoint(tmp_path, STARTED.format(body=body)))
    assert returned == code, stderr
    assert [(e.event, e.detail) for e in _events(tmp_path) if e.event != "started"][-1] == ending
    if code:
        assert "Traceback" in stderr or "exited 0 before" in stderr
