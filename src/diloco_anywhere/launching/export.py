"""``diloco export``: the trained model out of the bucket, as files a user can load anywhere.

A run's product is its global weights, which live in the bucket as checkpoint shards keyed by
DiLoCo's fragments. Export takes a committed checkpoint (the newest, or a chosen round), checked
as healing checks it (``load_checkpoint``: every object's size and CRC32C, the COMMIT last),
builds the run's task to get the model, puts each fragment's global weights
(``original_parameters``, arXiv 2311.08105 algorithm 1: what every replica agreed on) into it,
and writes:

- ``model.safetensors``: the model's whole ``state_dict`` (its buffers are the task's own),
  each tied or shared tensor once (``model_bytes``);
- ``README.md``: a model card (run, round and steps, tokens, held-out loss, bytes sent against
  data parallel for the same steps, the run's configuration);
- ``run.toml``: the configuration the run was published with;
- the task's own files when it has a ``save`` hook (``Task.save``: a ``save_pretrained``
  folder for a Hugging Face model), under ``saved/``.

The destination is a local folder or a store URL; either way the files are create-only
objects, like everything else the tool writes.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_model

from diloco_anywhere.bucket.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import RunConfig
from diloco_anywhere.launching.report import RunSummary, summarize
from diloco_anywhere.published_config import config_text
from diloco_anywhere.task import Task, TaskContext, build_task
from diloco_anywhere.training.builders import split_fragments
from diloco_anywhere.training.checkpoints.catalogue import newest_checkpoints
from diloco_anywhere.training.checkpoints.reader import load_checkpoint
from diloco_anywhere.training.checkpoints.records import Checkpoint, CheckpointError
from diloco_anywhere.training.global_state import FRAGMENT_KEY
from diloco_anywhere.training.metrics import MetricsReader

MODEL_FILE, CARD_FILE, CONFIG_FILE, SAVED_FOLDER = (
    "model.safetensors",
    "README.md",
    "run.toml",
    "saved",
)


class ExportError(ValueError):
    """Nothing to export, or nowhere to write it; the message says which and the fix."""


def committed_checkpoint(store: Store, layout: RunLayout, round_: int | None) -> Checkpoint:
    """The checkpoint of ``round_``, or the newest committed one that reads back intact."""
    if round_ is not None:
        try:
            return load_checkpoint(store, layout, round_)
        except CheckpointError as exc:
            raise ExportError(f"round {round_} has no intact committed checkpoint: {exc}") from None
    checkpoint = next(newest_checkpoints(store, layout), None)
    if checkpoint is None:
        raise ExportError(
            f"run {layout.run} has no committed checkpoint in {store.url}: export needs one "
            f"([checkpoint] every; the last outer step always writes one)"
        )
    return checkpoint


def trained_task(config: RunConfig, checkpoint: Checkpoint) -> Task:
    """The run's task, built on CPU, its model holding the checkpoint's global weights."""
    context = TaskContext(
        replica_index=0, replicas=config.run.replicas, seed=config.run.seed,
        device=torch.device("cpu"), options=config.task.options,
    )  # fmt: skip
    task = build_task(config.task.entrypoint, context)
    fragments = split_fragments(task.model, config.diloco.fragments)
    stored = checkpoint.tree.get("fragments", {})
    with torch.no_grad():
        for index, fragment in enumerate(fragments):
            weights = stored.get(FRAGMENT_KEY.format(index), {}).get("original_parameters", {})
            for name, parameter in fragment.named_parameters():
                if name not in weights or weights[name].shape != parameter.shape:
                    raise ExportError(
                        f"checkpoint of round {checkpoint.commit.round} has no global weights for "
                        f"fragment {index} parameter {name} {tuple(parameter.shape)}: the task or "
                        f"diloco.fragments differ from the run's"
                    )
                parameter.copy_(weights[name])
    return task


def model_card(config: RunConfig, checkpoint: Checkpoint, summary: RunSummary) -> str:
    """The README of the export: where the weights come from and what they cost."""
    saved = summary.bytes_saved_factor
    rows = [
        ("run", config.run.name),
        ("checkpoint", f"round {checkpoint.commit.round}, outer step {checkpoint.commit.step}"),
        ("replicas", str(summary.replicas)),
        ("inner steps per replica", str(summary.inner_steps_per_replica)),
        ("tokens (all replicas)", f"{summary.tokens:,}"),
        ("held-out loss", "n/a" if summary.eval_loss is None else f"{summary.eval_loss:.4f}"),
        ("bytes sent per replica", f"{summary.bytes_up_per_replica:,}"),
        ("data parallel would send", f"{summary.data_parallel_bytes_per_replica:,}"
         + ("" if saved is None else f" ({saved:.0f}x more)")),
    ]  # fmt: skip
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    return (
        f"---\ntags:\n- diloco\n- diloco-anywhere\n---\n\n# {config.run.name}\n\n"
        f"Global weights of a DiLoCo run (arXiv 2311.08105) trained with diloco-anywhere: "
        f"`{config.diloco.outer_steps}` outer steps of `{config.diloco.sync_every}` inner steps, "
        f"replicas exchanging pseudo-gradients through an object store.\n\n"
        f"| | |\n|---|---|\n{table}\n\n"
        f"`model.safetensors` holds the model's `state_dict`; `run.toml` the run's configuration "
        f"(the task `{config.task.entrypoint}` builds the model).\n"
    )


def _files(config: RunConfig, checkpoint: Checkpoint, summary: RunSummary) -> dict[str, bytes]:
    task = trained_task(config, checkpoint)
    files = {
        MODEL_FILE: model_bytes(task.model),
        CARD_FILE: model_card(config, checkpoint, summary).encode(),
        CONFIG_FILE: config_text(config),
    }  # fmt: skip
    if task.save is not None:
        with tempfile.TemporaryDirectory() as folder:
            task.save(task.model, Path(folder))
            for path in sorted(Path(folder).rglob("*")):
                if path.is_file():
                    files[f"{SAVED_FOLDER}/{path.relative_to(folder).as_posix()}"] = (
                        path.read_bytes()
                    )
    return files


def model_bytes(model: torch.nn.Module) -> bytes:
    """The model's ``state_dict`` as safetensors, a tensor shared by several names (a head tied
    to the embedding, GPT-2 style) stored once: safetensors' ``save_model`` keeps one name and
    records the others in the metadata, and ``load_model`` or ``from_pretrained`` tie them
    back. No other metadata: safetensors keeps it in a hash map whose order, and so the file's
    bytes, can change from one save to the next (the model card names run and round)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / MODEL_FILE
        save_model(model, str(path))
        return path.read_bytes()


def _write(destination: str, files: dict[str, bytes]) -> None:
    """Every file, create-only, through a store: a folder is a local store, so a second
    export of the same checkpoint is a no-op there too, and of another one an error."""
    with Store(destination) as store:
        try:
            store.put_many(files)
        except FileExistsError as exc:
            raise ExportError(f"{exc}: export to an empty folder") from None


def export(config: RunConfig, destination: str, round_: int | None = None) -> Checkpoint:
    """Write the run's global weights at ``round_`` (default: the newest committed checkpoint)
    to ``destination``; the checkpoint it exported."""
    layout = RunLayout(config.run.name)
    with Store(config.store_url()) as store:
        checkpoint = committed_checkpoint(store, layout, round_)
        summary = summarize(MetricsReader(store, layout).read())
    _write(destination, _files(config, checkpoint, summary))
    return checkpoint
