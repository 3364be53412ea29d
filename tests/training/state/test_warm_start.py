"""A warm start (``[task] init_from``): every replica starts from a safetensors file's weights,
checked against the model first; never a pickle."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import save_file, save_model

from diloco_anywhere.bench.chaos import fingerprint_disagreements
from diloco_anywhere.config import load_config
from diloco_anywhere.launching.start.launch import run_metrics
from diloco_anywhere.task import TaskContext, build_task
from diloco_anywhere.training.state.fingerprints import fingerprint
from diloco_anywhere.training.state.global_state import tree_checksum
from diloco_anywhere.training.state.warm_start import WarmStartError, load_weights, warm_start
from support.runs import RUN_TOML, diloco


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))


@pytest.mark.parametrize("as_url", [False, True])
def test_a_model_starts_from_the_files_weights(tmp_path, as_url) -> None:
    save_file(_model(1).state_dict(), tmp_path / "model.safetensors")
    model = _model(2)
    path = tmp_path / "model.safetensors"
    warm_start(model, f"file://{path}" if as_url else str(path))
    for name, tensor in _model(1).state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor)


def test_weights_that_do_not_fit_are_refused_naming_the_tensor(tmp_path) -> None:
    model, weights = _model(2), _model(1).state_dict()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    cases = {
        "missing ['1.bias']": {k: v for k, v in weights.items() if k != "1.bias"},
        "not in the model ['extra']": {**weights, "extra": torch.zeros(1)},
        "0.weight is (8, 5), the model's (8, 4)": {**weights, "0.weight": torch.zeros(8, 5)},
    }
    for expected, tensors in cases.items():
        with pytest.raises(WarmStartError, match=re.escape(expected)):
            load_weights(model, tensors, "model.safetensors")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())  # untouched

    (tmp_path / "pickle.pt").write_bytes(b"\x80\x04not safetensors")
    with pytest.raises(WarmStartError, match="is not a safetensors file torch can load"):
        warm_start(model, str(tmp_path / "pickle.pt"))
    with pytest.raises(WarmStartError, match="no such file"):
        warm_start(model, str(tmp_path / "absent.safetensors"))


def test_a_file_of_the_parameters_alone_leaves_the_model_s_buffers_as_they_are(tmp_path) -> None:
    """What diloco export writes: the global weights; running statistics are the model's."""
    torch.manual_seed(1)
    trained = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    save_file(dict(trained.named_parameters()), tmp_path / "parameters.safetensors")
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    model[1].running_mean.fill_(3.0)
    warm_start(model, str(tmp_path / "parameters.safetensors"))
    assert torch.equal(model[0].weight, trained[0].weight)
    assert torch.equal(model[1].running_mean, torch.full((8,), 3.0))


def _tied(seed: int) -> torch.nn.Module:
    """A head tied to the embedding, GPT-2 style: two names, one tensor."""
    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.embedding = torch.nn.Embedding(16, 4)
    model.head = torch.nn.Linear(4, 16, bias=False)
    model.head.weight = model.embedding.weight
    return model


def test_a_tied_tensor_stored_once_starts_both_its_names(tmp_path) -> None:
    """As safetensors' save_model (and so diloco export) writes it: one of the names only."""
    save_model(_tied(1), str(tmp_path / "model.safetensors"))
    model = _tied(2)
    warm_start(model, str(tmp_path / "model.safetensors"))
    assert torch.equal(model.embedding.weight, _tied(1).embedding.weight)
    assert model.head.weight is model.embedding.weight
    with pytest.raises(WarmStartError, match=re.escape("missing ['embedding.weight', 'head")):
        load_weights(_tied(2), {}, "m")  # neither name: still refused


def test_a_compiled_model_and_its_file_are_the_same_names(tmp_path) -> None:
    """torch.compile's wrapper names every tensor ``_orig_mod.<name>``: a file from either
    starts the other."""
    save_file(torch.compile(_model(1)).state_dict(), tmp_path / "compiled.safetensors")
    save_file(_model(1).state_dict(), tmp_path / "plain.safetensors")
    for model, file in ((_model(2), "compiled"), (torch.compile(_model(2)), "plain")):
        warm_start(model, str(tmp_path / f"{file}.safetensors"))
        assert torch.equal(model.state_dict()[next(iter(model.state_dict()))],
                           _model(1).state_dict()["0.weight"])  # fmt: skip


@pytest.mark.integration
def test_every_replica_of_a_run_starts_from_the_file(tmp_path, monkeypatch) -> None:
    """The round-0 fingerprint of both replicas is the file's weights' (the global state
    before the first outer step is the initial weights and an empty outer optimizer)."""
    monkeypatch.chdir(tmp_path)
    text = RUN_TOML.format(replicas=2, outer_steps=1).replace(
        "[task]", '[task]\ninit_from = "init.safetensors"'
    )
    (tmp_path / "run.toml").write_text(text)
    config = load_config(tmp_path / "run.toml")
    other = TaskContext(0, 2, seed=99, device=torch.device("cpu"), options=config.task.options)
    trained_elsewhere = build_task(config.task.entrypoint, other).model
    save_file(trained_elsewhere.state_dict(), tmp_path / "init.safetensors")

    result = diloco("launch", "--config", "run.toml")
    assert result.exit_code == 0, result.output
    metrics = run_metrics(config).read()
    assert fingerprint_disagreements(metrics) == {}
    weights = [p.detach() for _, p in trained_elsewhere.named_parameters()]
    expected = fingerprint(0, tree_checksum(weights))
    assert {replica.syncs[0].fingerprint for replica in metrics.values()} == {expected}
