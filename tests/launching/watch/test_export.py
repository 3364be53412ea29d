"""``diloco export``: a finished run's global weights, checked as healing checks them, as
safetensors the task's model loads, with a model card and the run's configuration; to a folder
or a store; the task's own save format when it has one."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model

from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import RunConfig, load_config
from diloco_anywhere.launching.watch.export import (
    GlobalWeights,
    global_weights,
    model_card,
    trained_task,
    write_weights,
)
from diloco_anywhere.launching.watch.report import RunSummary
from diloco_anywhere.training.checkpoints.catalogue import newest_checkpoints
from diloco_anywhere.training.checkpoints.commits import committed_rounds
from diloco_anywhere.training.state.global_state import FRAGMENT_KEY
from support.runs import RUN_TOML, diloco

SAVING_TASK = """
from pathlib import Path
import torch
from diloco_anywhere.tasks.gpt import build as build_gpt

def build(context):
    task = build_gpt(context)
    # a head tied to the embedding as GPT-2 and many Hugging Face models hold it: two names,
    # one tensor (the model's forward already reuses the embedding's weight)
    embedding = task.model.token_embedding.weight
    task.model.lm_head = torch.nn.Linear(embedding.shape[1], embedding.shape[0], bias=False)
    task.model.lm_head.weight = embedding
    task.save = lambda model, folder: (folder / "weights.json").write_text(
        '{"parameters": %d}' % sum(p.numel() for p in model.parameters()))
    return task
"""


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 2-replica local run of 2 outer steps, done, with its task saving its own format."""
    folder = tmp_path_factory.mktemp("run")
    (folder / "saving_task.py").write_text(SAVING_TASK)
    text = RUN_TOML.format(replicas=2, outer_steps=2)
    text = text.replace('store = "store"', f'store = "{folder / "store"}"')
    text = text.replace("[task]\n", '[task]\nentrypoint = "saving_task:build"\n')
    (folder / "run.toml").write_text(text)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.syspath_prepend(str(folder))
        patch.setenv("PYTHONPATH", str(folder))
        result = diloco("launch", "--config", "run.toml")
    assert result.exit_code == 0, result.output
    return folder


@pytest.mark.integration
def test_the_export_holds_the_committed_global_weights(finished_run, tmp_path, monkeypatch):
    monkeypatch.chdir(finished_run)
    monkeypatch.syspath_prepend(str(finished_run))
    result = diloco("export", str(tmp_path / "model"), "--config", "run.toml")
    assert result.exit_code == 0, result.output
    config = load_config(finished_run / "run.toml")
    [checkpoint] = list(newest_checkpoints(Store(config.store_url()), RunLayout("t")))[:1]
    assert f"exported round {checkpoint.commit.round}" in result.output
    path = tmp_path / "model" / "model.safetensors"
    with safe_open(path, "pt") as file:  # the tied head is stored once, named in the metadata
        assert file.metadata() == {"format": "pt", "lm_head.weight": "token_embedding.weight"}
    assert "lm_head.weight" not in load_file(path)  # as save_pretrained drops a tied head
    model = trained_task(config, global_weights(config, checkpoint)).model
    torch.nn.init.zeros_(model.token_embedding.weight)
    assert not load_model(model, path)[0]  # the task's model takes it, nothing missing
    assert model.lm_head.weight is model.token_embedding.weight  # still tied
    weights = checkpoint.tree["fragments"][FRAGMENT_KEY.format(0)]["original_parameters"]
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, weights[name].load())
    card = (tmp_path / "model" / "README.md").read_text()
    assert "# t\n" in card
    assert f"round {checkpoint.commit.round}" in card
    assert "held-out loss | n/a" not in card
    assert load_config(tmp_path / "model" / "run.toml").run.name == "t"
    saved = json.loads((tmp_path / "model" / "saved" / "weights.json").read_text())
    assert saved["parameters"] == sum(p.numel() for p in model.parameters())
    # the same checkpoint gives the same bytes, whatever the run (safetensors metadata did not)
    for attempt in range(3):
        again = tmp_path / f"again-{attempt}"
        assert diloco("export", str(again), "--config", "run.toml").exit_code == 0
        for path in (tmp_path / "model").rglob("*"):
            if path.is_file():
                assert (
                    again / path.relative_to(tmp_path / "model")
                ).read_bytes() == path.read_bytes()


@pytest.mark.integration
def test_an_export_to_a_store_is_create_only_and_the_same_export_again_a_no_op(
    finished_run, monkeypatch
):
    monkeypatch.chdir(finished_run)
    monkeypatch.syspath_prepend(str(finished_run))
    target = "memory://exports/t"
    assert diloco("export", target, "--config", "run.toml").exit_code == 0
    assert sorted(Store(target).list_prefix("")) == [
        "README.md", "model.safetensors", "run.toml", "saved/weights.json"
    ]  # fmt: skip
    assert diloco("export", target, "--config", "run.toml").exit_code == 0  # the same bytes
    config = load_config(finished_run / "run.toml")
    older = committed_rounds(Store(config.store_url()), RunLayout("t"))[-1]
    other = diloco("export", target, "--config", "run.toml", "--round", str(older))
    assert other.exit_code == 1
    assert "already exists; keys are create-only: export to an empty folder" in other.output


@pytest.mark.integration
def test_nothing_committed_or_a_missing_round_says_so(finished_run, tmp_path, monkeypatch):
    monkeypatch.chdir(finished_run)
    missing = diloco("export", str(tmp_path / "x"), "--config", "run.toml", "--round", "999")
    assert missing.exit_code == 1
    assert "round 999 has no intact committed checkpoint" in missing.output
    (tmp_path / "empty.toml").write_text(f'[run]\nname = "never"\nstore = "{tmp_path / "s"}"\n')
    nothing = diloco("export", str(tmp_path / "y"), "--config", str(tmp_path / "empty.toml"))
    assert nothing.exit_code == 1
    assert "run never has no committed checkpoint" in nothing.output
    assert "Traceback" not in nothing.output + missing.output


@pytest.mark.parametrize(
    ("task", "builder"),
    [({"command": ["python", "train.py", "--model", "my model"]},
      "(the run's script, `python train.py --model 'my model'`, builds the model)"),
     ({}, "(the task `diloco_anywhere.tasks.gpt:build` builds the model)")],
)  # fmt: skip
def test_the_model_card_names_what_built_the_model(task, builder):
    """A `[task] command` run's model is its script's: never the built-in task's."""
    config = RunConfig.model_validate({"task": task})
    summary = RunSummary(replicas=2, outer_steps=3, inner_steps_per_replica=30, tokens=900,
                         final_loss=None, eval_loss=None, bytes_up_per_replica=0,
                         bytes_down_per_replica=0, data_parallel_bytes_per_replica=0,
                         sync_exposed_seconds=0.0)  # fmt: skip
    checkpoint = SimpleNamespace(commit=SimpleNamespace(round=2, step=3))
    card = model_card(config, checkpoint, summary)
    assert builder in card
    assert ("gpt" in card) == (not task)


def test_weights_over_a_shard_are_written_as_transformers_shards_them_one_shard_at_a_time(
    tmp_path,
):
    """A model over ``SHARD_BYTES`` is written in shards and an index (``from_pretrained``'s
    format), each shard's tensors the only ones in memory while it is written; a tied name is
    recorded in the file that holds its tensor."""
    torch.manual_seed(0)
    tensors = {f"layer{k}.weight": torch.randn(16, 16) for k in range(5)}  # 1 KiB each
    weights = GlobalWeights(tensors, {"head.weight": "layer3.weight"})
    store = Store(str(tmp_path / "model"))
    write_weights(store, weights, shard_bytes=2048)
    index = json.loads((tmp_path / "model" / "model.safetensors.index.json").read_text())
    files = [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert index["metadata"] == {"total_size": 5 * 1024}
    assert index["weight_map"] == {
        "layer0.weight": files[0], "layer1.weight": files[0], "layer2.weight": files[1],
        "layer3.weight": files[1], "layer4.weight": files[2],
    }  # fmt: skip
    loaded = {}
    for name in files:
        loaded |= load_file(tmp_path / "model" / name)
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items())
    with safe_open(tmp_path / "model" / files[1], "pt") as file:
        assert file.metadata() == {"format": "pt", "head.weight": "layer3.weight"}
    write_weights(store, weights, shard_bytes=2048)  # the same export again: a no-op
    assert not (tmp_path / "model" / "model.safetensors").exists()
