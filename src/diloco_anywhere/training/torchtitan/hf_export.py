"""A torchtitan run's export in Hugging Face's layout::

    python -m diloco_anywhere.training.torchtitan.hf_export EXPORTED DESTINATION \\
        --module M --config F [--section.key value]

``diloco export`` writes the run's weights under torchtitan's own parameter names (it runs
where torchtitan need not be installed); this turns them into the layout
``transformers``' ``from_pretrained`` and torchtitan's own HF checkpoint loading read, with
the job's own converter (its model spec's ``state_dict_adapter``, ``to_hf``: names, and for
Llama the rotary permutation of the query and key weights), given the job's arguments as the
run's ``[task] command`` gave them. Beside ``model.safetensors`` it copies the model's
configuration and tokenizer files from the job's ``hf_assets_path`` (torchtitan's download
of the Hugging Face model puts them there), which ``from_pretrained`` reads first.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from diloco_anywhere.training.mistakes import ScriptMistakeError
from diloco_anywhere.training.torchtitan.parsing import parse_job

WEIGHTS = "model.safetensors"
# What from_pretrained reads beside the weights, where the job's hf_assets_path has them.
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json")  # fmt: skip


class HfExportError(ScriptMistakeError):
    """The export cannot be written in Hugging Face's layout: the job's model has no
    converter, its converter would leave weights out, or the export is another model's."""


def export_for_hugging_face(exported: Path, destination: Path, arguments: list[str]) -> list[str]:
    """Write ``exported``'s weights (``diloco export``'s) into ``destination`` in Hugging
    Face's layout, with the files of ``HF_FILES`` the job's ``hf_assets_path`` holds; the
    names of the files written."""
    config = parse_job(arguments)
    spec = config.model_spec
    if spec.state_dict_adapter is None:
        raise HfExportError(
            f"torchtitan's {spec.name} model has no state_dict_adapter: it has no Hugging Face "
            f"layout to export to; {exported / WEIGHTS} holds its weights in torchtitan's names"
        )
    model_config = spec.model
    model_config.update_from_config(config=config)
    adapter = spec.state_dict_adapter(model_config, config.hf_assets_path)
    state = model_state_dict(model_config, load_file(exported / WEIGHTS))
    weights = adapter.to_hf(state)
    lost = state.keys() - adapter.from_hf(weights).keys()
    if lost:
        raise HfExportError(
            f"torchtitan's {spec.name} converter leaves out {sorted(lost)[:5]}: its Hugging "
            f"Face layout cannot hold this model; {exported / WEIGHTS} holds all of it"
        )
    destination.mkdir(parents=True, exist_ok=True)
    weights = {name: tensor.contiguous() for name, tensor in weights.items()}
    save_file(weights, destination / WEIGHTS, metadata={"format": "pt"})
    assets = Path(config.hf_assets_path)
    copied = [name for name in HF_FILES if (assets / name).is_file()]
    for name in copied:
        shutil.copyfile(assets / name, destination / name)
    return [WEIGHTS, *copied]


def model_state_dict(model_config: Any, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``weights`` (the model's parameters by name, as the run exports them) as the model's own
    ``state_dict`` gives them, which its converter reads: a module may store its parameters
    otherwise than it holds them (torchtitan's fused ``wqkv`` saves as ``wq``, ``wk``,
    ``wv`` through a state-dict hook). The model is built on the meta device and holds
    ``weights`` themselves, no copy."""
    with torch.device("meta"):
        model = model_config.build()
    held = dict(model.named_parameters())
    if held.keys() != weights.keys():
        raise HfExportError(
            f"the export's weights are not this job's model's: it has "
            f"{sorted(held.keys() - weights.keys())[:5]} that the export lacks, and the export "
            f"{sorted(weights.keys() - held.keys())[:5]} that it lacks; give the job's own "
            f"--module, --config and overrides"
        )
    for name, tensor in weights.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return model.state_dict()


def main(arguments: list[str]) -> None:
    if len(arguments) < 2 or arguments[0].startswith("-") or arguments[1].startswith("-"):
        sys.exit(__doc__)
    exported, destination, job = Path(arguments[0]), Path(arguments[1]), arguments[2:]
    try:
        written = export_for_hugging_face(exported, destination, job)
    except ScriptMistakeError as refused:
        sys.exit(f"error: {refused}")
    print(f"{destination}: {', '.join(written)}")


if __name__ == "__main__":
    main(sys.argv[1:])
