"""The names a checkpoint records (``parameter_names.py``): each fragment's global weights by
the model's parameter names, a tied weight once with its other names, a compiled model's the
same as the model's; and a record from the bucket that does not describe its weights refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from diloco_anywhere import join
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import RunConfig
from diloco_anywhere.training.builders import split_fragments
from diloco_anywhere.training.checkpoints.catalogue import newest_checkpoints
from diloco_anywhere.training.state.global_state import FRAGMENT_KEY
from diloco_anywhere.training.state.parameter_names import NamesError, named_weights, stored_names


class TiedLM(nn.Module):
    """A language model's shape: an embedding, a block, a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.block = nn.Linear(4, 4)
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight


def _saved(fragments: list[nn.Module]) -> dict:
    """The fragments' state as a checkpoint holds it (DiLoCo's keys)."""
    return {
        FRAGMENT_KEY.format(i): {
            "original_parameters": {k: p.detach().clone() for k, p in f.named_parameters()}
        }
        for i, f in enumerate(fragments)
    }


@pytest.mark.parametrize("fragments", [1, 2])
def test_the_weights_come_back_by_the_model_s_names_with_the_tied_head_once(fragments):
    torch.manual_seed(0)
    model = TiedLM()
    split = split_fragments(model, fragments)
    names = stored_names(model, split)
    assert names["tied"] == {"head.weight": "embed.weight"}  # the embedding kept, as HF does
    weights, tied = named_weights(_saved(split), names)
    assert sorted(weights) == ["block.bias", "block.weight", "embed.weight"]
    every = {**weights, **{name: weights[to] for name, to in tied.items()}}
    for name, tensor in model.state_dict().items():
        assert torch.equal(every[name], tensor), name
    if fragments == 2:  # DiLoCo's own keys are the fragment's, not the model's
        assert set(split[1].state_dict()) <= {"params.0", "params.1", "params.2"}


def test_a_compiled_model_records_the_names_of_the_model_itself():
    model = TiedLM()
    compiled = torch.compile(model)  # compiled lazily: its names already carry _orig_mod.
    assert next(iter(dict(compiled.named_parameters()))).startswith("_orig_mod.")
    assert stored_names(compiled, [compiled]) != stored_names(model, [model])  # fragment keys
    assert stored_names(compiled, [compiled])["fragments"][FRAGMENT_KEY.format(0)] == {
        f"_orig_mod.{name}": name for name in ("embed.weight", "block.weight", "block.bias")
    }
    assert stored_names(compiled, [compiled])["tied"] == {"head.weight": "embed.weight"}


def test_a_checkpoint_wrapped_layer_records_the_names_of_the_layer_itself():
    """Activation checkpointing's wrapper (torchtitan puts one around every layer) is no part
    of the model's names: an export under them loads into the bare model."""
    model = TiedLM()
    bare = stored_names(model, [model])
    model.block = checkpoint_wrapper(model.block)
    assert "block._checkpoint_wrapped_module.weight" in dict(model.named_parameters())
    wrapped = stored_names(model, [model])
    assert sorted(wrapped["fragments"][FRAGMENT_KEY.format(0)].values()) == sorted(
        bare["fragments"][FRAGMENT_KEY.format(0)].values()
    )  # fmt: skip
    assert wrapped["tied"] == bare["tied"]


def _names_and_state():
    model = TiedLM()
    split = split_fragments(model, 2)
    return stored_names(model, split), _saved(split)


def _renamed(names: dict, fragment: int, key: str, name: str) -> dict:
    mapping = dict(names["fragments"][FRAGMENT_KEY.format(fragment)])
    mapping[key] = name
    return {**names, "fragments": {**names["fragments"], FRAGMENT_KEY.format(fragment): mapping}}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda n: {"fragments": n["fragments"]}, "names must hold 'fragments' and 'tied'"),
        (lambda n: {**n, "fragments": {}}, r"names cover fragments \[\]"),
        (lambda n: _renamed(n, 1, "params.9", "x"), "StreamingDiLoCoFragment_1: names for"),
        (lambda n: _renamed(n, 1, "params.0", "embed.weight"), "two weights are named"),
        (lambda n: _renamed(n, 0, "params.0", 7), "StreamingDiLoCoFragment_0: names for"),
        (lambda n: {**n, "tied": {"head.weight": "nowhere"}}, "each must be tied to a stored"),
        (lambda n: {**n, "tied": {"block.bias": "embed.weight"}}, "and be none of them"),
        (lambda n: {**n, "tied": ["head.weight"]}, "tied names list"),
    ],
)
def test_names_that_do_not_describe_the_weights_are_refused(change, message):
    names, state = _names_and_state()
    with pytest.raises(NamesError, match=message):
        named_weights(state, change(names))


def test_a_compiled_model_s_checkpoint_holds_the_model_s_own_names(tmp_path):
    """DiLoCo is given the module torch.compile wraps: a replica that compiles and one that
    does not write (and heal from) checkpoints of the same keys."""
    config = RunConfig.model_validate({
        "run": {"name": "c", "store": str(tmp_path / "store"), "replicas": 1},
        "diloco": {"sync_every": 2, "outer_steps": 1},
    })  # fmt: skip
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    compiled = torch.compile(model, backend="eager")
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with join(config, replica_id="local-0") as replica, replica.diloco(compiled, inner) as training:
        for x in training.batches(lambda start: iter(lambda: torch.ones(2, 4), None)):
            compiled(x).pow(2).mean().backward()
            inner.step()
            inner.zero_grad()
    checkpoint = next(newest_checkpoints(Store(str(tmp_path / "store")), RunLayout("c")))
    fragment = checkpoint.tree["fragments"][FRAGMENT_KEY.format(0)]
    assert sorted(fragment["original_parameters"]) == ["bias", "weight"]
    assert checkpoint.tree["names"]["fragments"][FRAGMENT_KEY.format(0)] == {
        "bias": "bias", "weight": "weight"
    }  # fmt: skip
