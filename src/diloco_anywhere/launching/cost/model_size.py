"""The model's parameter count before any training, which the estimate's traffic (``traffic``)
scales with: from run.toml, or by building the built-in GPT on the meta device (torch imported
only then, so the CLI stays torch-free), never by building a task that may download weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diloco_anywhere.config import RunConfig

GPT_ENTRYPOINT = "diloco_anywhere.tasks.gpt:build"


def _gpt_parameters(options: Mapping[str, Any]) -> int:
    """The built-in GPT's parameter count, its modules built on the meta device: shapes, no
    memory, no weights, no corpus (``tasks/gpt.py`` reads ``preset`` and ``seq_len`` so)."""
    import torch

    from diloco_anywhere.tasks import gpt

    name = options.get("preset", "tiny")
    if name not in gpt.PRESETS:
        raise ValueError(f"task preset {name!r} unknown; choose one of {list(gpt.PRESETS)}")
    preset = gpt.PRESETS[name]
    seq_len = int(options.get("seq_len", preset.seq_len))
    with torch.device("meta"):
        model = gpt.GPT(gpt.Preset(preset.layers, preset.d_model, preset.heads, seq_len),
                        torch.Generator())  # fmt: skip
    return sum(parameter.numel() for parameter in model.parameters())


def parameter_count(config: RunConfig) -> tuple[int | None, str]:
    """(parameters, where the number came from): ``[budget] parameters``; else the built-in
    GPT task counted on the meta device; else None, saying what to set. Other tasks are not
    built here: building one may download weights or data (the Hugging Face task does)."""
    if config.budget.parameters:
        return config.budget.parameters, "[budget] parameters"
    missing = "unknown: set [budget] parameters (the model's parameter count)"
    if config.task.command or config.task.entrypoint != GPT_ENTRYPOINT:
        what = "[task] command" if config.task.command else config.task.entrypoint
        return None, f"{missing}; {what} is not built before training"
    try:
        return _gpt_parameters(config.task.options), "the built-in GPT task, counted on meta"
    except (ValueError, TypeError, RuntimeError) as exc:  # what a bad option raises in torch
        return None, f"{missing}; the GPT task's [task.options] do not build: {exc}"
