"""A warm start: every replica's model starts from weights in a safetensors file.

DiLoCo's headline results start from a model a single worker pretrained, not from scratch
(arXiv 2311.08105, section 4: "we start from a pretrained checkpoint"), and a user fine-tuning
starts from weights too. ``[task] init_from`` names that file: a path (relative to run.toml's
folder) or a store URL, such as the ``model.safetensors`` that ``diloco export`` writes. The
built-in loop loads it into the task's model before training, so every replica holds the same
initial global weights (the round fingerprints show it).

The file is bucket data: safetensors only, never a pickle, and every tensor is checked
against the model before anything is copied: the same names, the same shapes.
"""

from __future__ import annotations

from pathlib import PurePosixPath

import torch
from safetensors.torch import load as load_safetensors
from torch import nn

from diloco_anywhere.bucket.redaction import redact_url
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import ConfigError
from diloco_anywhere.training.state.parameter_names import parameter_name


class WarmStartError(ConfigError):
    """The file cannot start this model; the message names the file, the tensor and why (a
    configuration error: the replica exits 2, and is not restarted to fail again)."""


def read_weights(url: str) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file at ``url`` (a local path or a store URL)."""
    parent, name = str(PurePosixPath(url).parent), PurePosixPath(url).name
    if "://" in url:  # PurePosixPath folds the '//' of a scheme: split the URL itself
        parent, _, name = url.rpartition("/")
    with Store(parent) as store:
        try:
            data = store.get(name)
        except FileNotFoundError:
            raise WarmStartError(f"task.init_from {redact_url(url)!r}: no such file") from None
    try:
        return load_safetensors(data)
    except Exception as exc:  # SafetensorError, or a dtype torch lacks: bucket data, not weights
        raise WarmStartError(
            f"task.init_from {redact_url(url)!r} is not a safetensors file torch can load: {exc}"
        ) from None


def load_weights(model: nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Copy ``tensors`` into ``model``'s state, after checking they are the model's: every
    parameter (a tied tensor under one of its names), buffers if the file has them (an export
    holds the parameters alone: buffers are no part of DiLoCo's global state), nothing else,
    each in the model's shape (a dtype is cast). Names are compared without
    ``torch.compile``'s prefix (``parameter_names.py``)."""
    state = {parameter_name(name): value for name, value in model.state_dict().items()}
    tensors = {parameter_name(name): tensor for name, tensor in tensors.items()}
    parameters = {
        parameter_name(name) for name, _ in model.named_parameters(remove_duplicate=False)
    }
    missing = sorted(name for name in parameters - tensors.keys()
                     if not _tied(state, name) & tensors.keys())  # fmt: skip
    extra = sorted(tensors.keys() - state.keys())
    if missing or extra:
        raise WarmStartError(
            f"task.init_from {source!r} does not fit the task's model: missing {missing[:3]}, "
            f"not in the model {extra[:3]} (the file must hold every parameter of the model "
            f"by name, as diloco export writes them)"
        )
    for name, tensor in tensors.items():
        if tensor.shape != state[name].shape:
            raise WarmStartError(
                f"task.init_from {source!r}: {name} is {tuple(tensor.shape)}, the model's "
                f"{tuple(state[name].shape)}"
            )
    with torch.no_grad():
        for name, tensor in tensors.items():
            state[name].copy_(tensor)


def _tied(state: dict[str, torch.Tensor], name: str) -> set[str]:
    """The other names of ``state`` holding the very tensor ``name`` holds (a head tied to the
    embedding): a file need hold one of them, as safetensors' ``save_model`` (and so
    ``diloco export``) stores a tied tensor once."""
    where = (state[name].data_ptr(), state[name].shape)
    return {
        other for other, tensor in state.items()
        if other != name and (tensor.data_ptr(), tensor.shape) == where
    }  # fmt: skip


def warm_start(model: nn.Module, url: str) -> None:
    """Start ``model`` from the file at ``url`` (``[task] init_from``)."""
    load_weights(model, read_weights(url), redact_url(url))
