"""Every fix a mistake's message or docs/api.md's mistakes tables name runs as written.

A fix that is code (a Trainer's argument, a ``with``, a command's argument) is pasted, as the
text says it, into a script that then runs: a fix that raises (a ``DilocoCallback`` that needed
an argument the message left out did) fails here. A fix that names a setting, a command or an
API is looked up where it must exist. A new fix in a message or the docs that none of these
knows fails ``test_every_fix_named_is_one_this_module_runs_or_finds``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from diloco_anywhere import DilocoCallback, join
from diloco_anywhere.config import RunConfig
from diloco_anywhere.launching.start.launch import run_metrics
from diloco_anywhere.training.command import with_identity
from diloco_anywhere.training.mistakes.output_claims import _refusal
from diloco_anywhere.training.mistakes.outside_diloco import _message
from diloco_anywhere.training.replica import Replica
from support.docs import DOCS
from support.hf import TINY_LLAMA
from support.runs import diloco

SEQ_LEN = 16
FIRST_TABLE, LAST_SECTION = "## Mistakes that stop a replica at once", "## The all-reduce alone"


def _docs_fixes() -> set[str]:
    """The code in the last column of docs/api.md's two mistakes tables: what to do."""
    text = DOCS.read_text()
    section = text[text.index(FIRST_TABLE) : text.index(LAST_SECTION)]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return {code for row in rows for code in re.findall(r"`([^`]+)`", row.rsplit("|", 2)[-2])}


def _message_fixes() -> set[str]:
    """The code in the messages that name a fix as code (``base``: a folder named ``out``)."""
    messages = [_message(11, trainer=True), _message(11, trainer=False),
                _refusal("out", Path("claims/out"), "run", "local-0", "local-1")]  # fmt: skip
    found = {code for message in messages for code in re.findall(r"`([^`]+)`", message)}
    return found | set(re.findall(r"TrainingArguments\([^`]*?\)\)", messages[2]))


def _one_replica(tmp_path) -> RunConfig:
    return RunConfig.model_validate({
        "run": {"name": "fixes", "store": str(tmp_path / "store"), "replicas": 1,
                "min_replicas": 1},
        "diloco": {"sync_every": 3, "outer_steps": 1},
    })  # fmt: skip


def _two_replicas(tmp_path) -> RunConfig:
    return RunConfig.model_validate({
        "run": {"name": "fixes", "store": str(tmp_path / "store"), "replicas": 2,
                "min_replicas": 1},
        "diloco": {"sync_every": 3, "outer_steps": 1},
        "sync": {"grace": 0.5},
    })  # fmt: skip


def _trainer_namespace(replica: Replica, tmp_path) -> dict:
    """What a Trainer script has in hand where the fix is pasted."""
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (64, SEQ_LEN))
    return {
        "replica": replica, "DilocoCallback": DilocoCallback, "Trainer": Trainer,
        "TrainingArguments": TrainingArguments, "os": __import__("os"),
        "model": LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "vocab_size": 64})),
        "args": TrainingArguments(str(tmp_path / "trainer"), per_device_train_batch_size=4,
                                  save_strategy="no", report_to="none", use_cpu=True),
        "dataset": [{"input_ids": row, "labels": row} for row in ids],
    }  # fmt: skip


def _ended(config: RunConfig, replica_id: str) -> str:
    return run_metrics(config).read()[replica_id].ending().event


def paste_trainer_callbacks(fix: str, tmp_path, monkeypatch) -> None:
    """A Trainer given the callback as the message says trains the run to its end."""
    config = _one_replica(tmp_path)
    with join(config, replica_id="local-0") as replica:
        script = f"Trainer(model=model, args=args, train_dataset=dataset, {fix}).train()"
        exec(script, _trainer_namespace(replica, tmp_path))  # the fix, as pasted
    assert _ended(config, "local-0") == "done"


def paste_training_arguments(fix: str, tmp_path, monkeypatch) -> None:
    """Two replicas of one script whose Trainers save checkpoints, each given the arguments
    the fix says, as written: neither is refused a shared output_dir."""
    monkeypatch.chdir(tmp_path)  # relative folders, as in run.toml's folder
    config, built = _two_replicas(tmp_path), []
    with join(config, replica_id="local-0") as one, join(config, replica_id="local-1") as other:
        for replica in (one, other):
            namespace = _trainer_namespace(replica, tmp_path)
            arguments = fix if fix.startswith("TrainingArguments(") else (
                f'TrainingArguments(output_dir="shared", {fix})')  # fmt: skip
            script = (f"args = {arguments}\nTrainer(model=model, args=args, "
                      "train_dataset=dataset, callbacks=[DilocoCallback(replica)])")  # fmt: skip
            exec(script, namespace)  # the fix, as pasted
            built.append(namespace["args"].output_dir)
    assert len(built) == 2


def paste_loop(fix: str, tmp_path, monkeypatch) -> None:
    """A plain loop trained inside the ``with`` the message names trains the run to its end."""
    config = _one_replica(tmp_path)
    opening = fix if fix.endswith(":") else f"{fix} as training:"
    script = (f"{opening}\n    for x in training.batches(data):\n"
              "        model(x).pow(2).mean().backward()\n"
              "        optimizer.step()\n        optimizer.zero_grad()\n")  # fmt: skip
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    namespace = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
                 "data": lambda start: iter(lambda: torch.randn(8, 4), None)}  # fmt: skip
    with join(config, replica_id="local-0") as replica:
        exec(script, {**namespace, "replica": replica})  # the fix, as pasted
    assert _ended(config, "local-0") == "done"


def paste_command_argument(fix: str, tmp_path, monkeypatch) -> None:
    """``[task] command``'s arguments as the fix writes them: each replica its own folder."""
    folders = {with_identity(["python", "run_clm.py", *fix.split()],
                             {"DILOCO_REPLICA_ID": f"local-{k}", "DILOCO_REPLICA_INDEX": str(k),
                              "DILOCO_PLATFORM": "local"})[-1] for k in range(3)}  # fmt: skip
    assert folders == {"out/local-0", "out/local-1", "out/local-2"}


# Each fix that is code, as the messages and docs write it, and what pastes it.
PASTED = {
    "callbacks=[DilocoCallback(replica)]": paste_trainer_callbacks,
    'TrainingArguments(output_dir=f"out/{replica.replica_id}")': paste_training_arguments,
    'TrainingArguments(output_dir=os.path.join("out", replica.replica_id))':
        paste_training_arguments,
    'save_strategy="no"': paste_training_arguments,
    "with replica.diloco(model, optimizer)": paste_loop,
    "with replica.diloco(model, optimizer) as training:": paste_loop,
    "--output_dir out/$DILOCO_REPLICA_ID": paste_command_argument,
}  # fmt: skip
# What names an API to use: where it must be found.
APIS = {"step()": torch.optim.Optimizer, "replica.stream(...)": Replica,
        "DilocoCallback.dataset": DilocoCallback}  # fmt: skip
SETTING = re.compile(r"^(?:\[(\w+)\] |(\w+)\.)?(\w+)$")  # [task] init_from, run.min_replicas
COMMANDS = re.compile(r"^diloco (\w+)")  # diloco replace, diloco logs REPLICA
# Words quoted that are neither code nor a setting: events, other tools' commands, variables the
# platform reads, a docs section's title.
QUOTED = {"done", "failed", "HF_TOKEN", "modal token new", "Trainer"}


def _is_code(fix: str) -> bool:
    return fix not in APIS and bool(re.search(r"[(=]|^with |^--", fix))


def test_every_fix_named_is_one_this_module_runs_or_finds():
    fixes = _docs_fixes() | _message_fixes()
    code = {fix for fix in fixes if _is_code(fix)}
    assert code <= PASTED.keys(), f"fixes no test pastes: {sorted(code - PASTED.keys())}"
    assert {"callbacks=[DilocoCallback(replica)]", 'save_strategy="no"'} <= code  # found
    others = fixes - code - APIS.keys() - QUOTED
    for fix in others:
        assert SETTING.match(fix) or COMMANDS.match(fix), f"{fix!r}: what kind of fix is it?"


@pytest.mark.parametrize("fix", sorted(PASTED))
def test_a_fix_pasted_as_written_runs(fix, tmp_path, monkeypatch):
    PASTED[fix](fix, tmp_path, monkeypatch)


def test_the_settings_commands_and_apis_the_fixes_name_exist():
    fixes = _docs_fixes() | _message_fixes()
    sections = RunConfig.model_fields
    for fix in fixes - APIS.keys() - QUOTED:
        if setting := SETTING.match(fix):
            section, key = setting.group(1) or setting.group(2), setting.group(3)
            if section is not None:
                assert key in sections[section].annotation.model_fields, fix
            else:
                assert any(key in getattr(field.annotation, "model_fields", ())
                           for field in sections.values()), fix  # fmt: skip
        elif command := COMMANDS.match(fix):
            assert diloco(command.group(1), "--help").exit_code == 0, fix
    for fix, owner in APIS.items():
        assert hasattr(owner, fix.split("(")[0].rsplit(".", 1)[-1]), fix
