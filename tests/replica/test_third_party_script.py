"""A third-party script as every replica (``support/char_gpt.py``: nanoGPT's shape, with tied
embeddings, gradient accumulation and an fp16-style skipped step, ``torch.compile``, the global
RNG seeded per rank, logging every few steps), made a replica by a few marked lines and run
through ``diloco launch`` with ``[task] command``: it trains, one replica killed by SIGKILL
heals, and ``diloco export`` gives a file its own model class loads, whose held-out loss is
the run's."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_model

from diloco_anywhere.config import load_config
from diloco_anywhere.training.fixed_rng import fixed_random_state
from support.char_gpt import MODEL, TRAIN
from support.runs import diloco, statuses

pytestmark = pytest.mark.integration  # it starts processes

RUN_TOML = f"""
[run]
name = "chargpt"
store = "store"
replicas = 2
min_replicas = 2
[diloco]
sync_every = 8
outer_steps = 5
fragments = 2
codec = "fp32"
[sync]
grace = 2.0
timeout = 60.0
lease_period = 1.0
[keep]
backoff = 0.5
[task]
command = {json.dumps(["python", "train.py"])}
log_every = 5
eval_every = 1
"""


def _own_module(path):
    """The script's ``model.py``, imported as the user's code would be."""
    spec = importlib.util.spec_from_file_location("char_gpt_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_nanogpt_style_script_trains_heals_and_exports_into_its_own_model_class(
    tmp_path, monkeypatch
):
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "run.toml").write_text(RUN_TOML)
    monkeypatch.chdir(tmp_path)
    result = diloco("launch", "--config", "run.toml", "--restart-on-failure")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "killed").exists()  # the fault happened
    rows = statuses("run.toml")
    assert {(row["state"], row["outer_step"]) for row in rows.values()} == {("done", 5)}
    assert (rows["local-1"]["restarts"], rows["local-1"]["heals"] >= 1) == (1, True)
    assert all(row["loss"] is not None and "lr" in row["values"] for row in rows.values())
    [eval_loss] = {row["eval_loss"] for row in rows.values()}  # the agreed weights' loss

    exported = diloco("export", "exported", "--config", "run.toml")
    assert exported.exit_code == 0, exported.output
    path = tmp_path / "exported" / "model.safetensors"
    with safe_open(path, "pt") as file:
        names, metadata = set(file.keys()), file.metadata()
    assert metadata == {"format": "pt", "lm_head.weight": "token_embedding.weight"}
    assert not any(name.startswith("_orig_mod.") for name in names)  # compiled, named as not

    own = _own_module(tmp_path / "model.py")
    assert eval_loss < math.log(len(own.VOCAB))  # it learned: below a uniform guess
    model = own.CharGPT()  # the user's class, with weights of its own
    missing, unexpected = load_model(model, path)
    assert (missing, unexpected) == (set(), [])
    assert model.lm_head.weight is model.token_embedding.weight  # still tied
    seed = load_config(tmp_path / "run.toml").run.seed
    with fixed_random_state(seed, torch.device("cpu")):  # as the run evaluates
        assert own.estimate_loss(model) == pytest.approx(eval_loss, rel=1e-5)
