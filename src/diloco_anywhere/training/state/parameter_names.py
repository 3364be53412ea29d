"""A parameter's name as the run stores and compares it, and the names a checkpoint records.

Names lose the prefixes torch's wrappers put before the names of the module they wrap, none
of them the model's own: ``torch.compile``'s (``_orig_mod.``) and activation checkpointing's
(``_checkpoint_wrapped_module.``, which torchtitan puts around every layer), as torch's own
distributed checkpoint drops them (``torch/distributed/checkpoint/state_dict.py``,
``_get_fqns``). So a compiled or checkpoint-wrapped model and the same model bare are one
model to the run's initial state, to ``init_from``, to checkpoints (DiLoCo is given the
module the compile wrapper holds: ``uncompiled``) and to an export, whose names are then the
ones the model's own ``state_dict`` loads.

DiLoCo keys each fragment's global weights by the fragment's own names: the model's names with
one fragment, ``params.{i}`` with several (``builders.split_fragments``), and a tied weight
(a head sharing the embedding's tensor) under one name only. So every checkpoint also records
``names`` (``stored_names``): each fragment's keys mapped to the model's names, and the names
tied to them, which is all ``diloco export`` needs to write the weights by name without
building the model (``named_weights``); a model class of the user's own, or
``from_pretrained``, then loads them with no code of ours.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from diloco_anywhere.training.state.global_state import FRAGMENT_KEY

WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.")


def parameter_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def uncompiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (its ``OptimizedModule`` keeps it as
    ``_orig_mod``), or ``model`` itself: what DiLoCo is given, so that its keys, and so every
    checkpoint's, are the model's own names whether a replica compiled it or not (one replica
    heals from another's checkpoint)."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else model


def stored_names(model: nn.Module, fragments: list[nn.Module]) -> dict[str, Any]:
    """``{"fragments": {fragment key: {key in the fragment: name in the model}}, "tied":
    {name: the name it is tied to}}``. A tensor under several names is stored under the one
    ``named_parameters`` lists first, as Hugging Face keeps the input embedding and drops the
    tied head (``_tied_weights_keys``); the others are tied to it."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        name = parameter_name(name)
        if id(parameter) in first:
            tied[name] = first[id(parameter)]
        else:
            first[id(parameter)] = name
    by_fragment = {
        FRAGMENT_KEY.format(index): {key: first[id(p)] for key, p in fragment.named_parameters()}
        for index, fragment in enumerate(fragments)
    }
    return {"fragments": by_fragment, "tied": tied}


class NamesError(ValueError):
    """A checkpoint's names that do not describe its weights; the message says how."""


def named_weights(
    fragments: dict[str, Any], names: Any
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The global weights of a checkpoint's ``fragments`` by the model's names, and the names
    tied to them, as ``names`` (``stored_names``, read from the bucket: checked) gives them."""
    if not (isinstance(names, dict) and names.keys() == {"fragments", "tied"}):
        raise NamesError("names must hold 'fragments' and 'tied'")
    by_fragment, tied = names["fragments"], names["tied"]
    if not (isinstance(by_fragment, dict) and by_fragment.keys() == fragments.keys()):
        raise NamesError(f"names cover fragments {_listed(by_fragment)}, the state holds "
                         f"{sorted(fragments)}")  # fmt: skip
    weights: dict[str, torch.Tensor] = {}
    for key, mapping in by_fragment.items():
        stored = fragments[key].get("original_parameters", {})
        if not (_strings(mapping) and mapping.keys() == stored.keys()):
            raise NamesError(f"{key}: names for {_listed(mapping)}, its global weights are "
                             f"{sorted(stored)}")  # fmt: skip
        for local, name in mapping.items():
            if name in weights:
                raise NamesError(f"{key}: two weights are named {name!r}")
            weights[name] = stored[local]
    if not (_strings(tied) and set(tied.values()) <= weights.keys()) or tied.keys() & weights:
        raise NamesError(f"tied names {_listed(tied)}: each must be tied to a stored weight, "
                         f"and be none of them")  # fmt: skip
    return weights, tied


def _strings(mapping: Any) -> bool:
    return isinstance(mapping, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()
    )


def _listed(value: Any) -> str:
    return str(sorted(map(str, value))[:5]) if isinstance(value, dict) else type(value).__name__
