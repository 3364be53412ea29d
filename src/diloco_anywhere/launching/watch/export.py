"""``diloco export``: the trained model out of the bucket, as files a user can load anywhere.

A run's product is its global weights, which live in the bucket as checkpoint shards keyed by
DiLoCo's fragments. Export takes a committed checkpoint (the newest, or a chosen round), checked
as healing checks it (``open_checkpoint``: every object's size and CRC32C, every value finite,
the fingerprint the COMMIT's), its tensors read a slice at a time as they are written out,
names each fragment's global weights (``original_parameters``, arXiv 2311.08105 algorithm 1:
what every replica agreed on) by the model's parameter names the checkpoint records
(``parameter_names.py``), with no model built, so it works for a run of any script
(``[task] command``), and writes:

- ``model.safetensors``: the model's parameters by name, each tied or shared tensor once
  (``write_weights``); buffers are not DiLoCo's global state, so a model loading it keeps its
  own (load it with ``strict=False`` where the model has persistent buffers). A model over
  ``SHARD_BYTES`` is written as transformers writes a large one, shards
  ``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json`` (which
  ``from_pretrained`` reads), one shard in memory at a time;
- ``README.md``: a model card (run, round and steps, tokens, held-out loss, bytes sent against
  data parallel for the same steps, the run's configuration);
- ``run.toml``: the configuration the run was published with;
- the files the script added (``Replica.add_to_export``: a Hugging Face model's
  ``config.json``, which ``DilocoCallback`` adds, so that ``from_pretrained`` loads the
  folder);
- the task's own files when it has a ``save`` hook (``Task.save``: a ``save_pretrained``
  folder for a Hugging Face model), under ``saved/``.

The destination is a local folder or a store URL; either way the files are create-only
objects, like everything else the tool writes.
"""

from __future__ import annotations

import json
import shlex
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import RunConfig
from diloco_anywhere.launching.watch.report import RunSummary, summarize
from diloco_anywhere.published_config import config_text
from diloco_anywhere.task import Task, build_task
from diloco_anywhere.training.builders import SINGLE_PROCESS, split_fragments, task_context
from diloco_anywhere.training.checkpoints.catalogue import newest_checkpoints
from diloco_anywhere.training.checkpoints.reader import open_checkpoint
from diloco_anywhere.training.checkpoints.records import Checkpoint, CheckpointError
from diloco_anywhere.training.records.metrics import MetricsReader
from diloco_anywhere.training.state.export_files import ExportFileError, read_export_files
from diloco_anywhere.training.state.global_state import fill_from
from diloco_anywhere.training.state.parameter_names import (
    NamesError,
    named_weights,
    stored_names,
)

MODEL_FILE, CARD_FILE, CONFIG_FILE, SAVED_FOLDER = (
    "model.safetensors",
    "README.md",
    "run.toml",
    "saved",
)
INDEX_FILE = "model.safetensors.index.json"  # a sharded export's: tensor name -> its file
# The weights' files are shards of at most this many bytes: one is read into memory at a time
# while it is written (transformers' save_pretrained shards at 5 GB)
SHARD_BYTES = 256 << 20


class ExportError(ValueError):
    """Nothing to export, or nowhere to write it; the message says which and the fix."""


def committed_checkpoint(store: Store, layout: RunLayout, round_: int | None) -> Checkpoint:
    """The checkpoint of ``round_``, or the newest committed one that reads back intact, its
    tensors read when written out (``open_checkpoint``; ``close`` is the caller's)."""
    if round_ is not None:
        try:
            return open_checkpoint(store, layout, round_)
        except CheckpointError as exc:
            raise ExportError(f"round {round_} has no intact committed checkpoint: {exc}") from None
    checkpoint = next(newest_checkpoints(store, layout), None)
    if checkpoint is None:
        raise ExportError(
            f"run {layout.run} has no committed checkpoint in {store.url}: export needs one "
            f"([checkpoint] every; the last outer step always writes one)"
        )
    return checkpoint


@dataclass(frozen=True)
class GlobalWeights:
    """A checkpoint's global weights by the model's parameter names, and the names tied to
    them (``{name: the stored name}``)."""

    tensors: dict[str, torch.Tensor]
    tied: dict[str, str]

    def loaded(self) -> GlobalWeights:
        """These weights read into memory (a checkpoint's are read when asked)."""
        return GlobalWeights({name: _loaded(t) for name, t in self.tensors.items()}, self.tied)

    def by_every_name(self) -> dict[str, torch.Tensor]:
        """Every name, a tied one with its stored tensor: a model's ``state_dict`` keys."""
        return {**self.tensors, **{name: self.tensors[to] for name, to in self.tied.items()}}


def global_weights(config: RunConfig, checkpoint: Checkpoint) -> GlobalWeights:
    """The checkpoint's global weights by name, as its ``names`` record says
    (``parameter_names``): no model is built. A checkpoint written before names were
    recorded takes them from the run's task, rebuilt."""
    fragments = checkpoint.tree.get("fragments", {})
    names = checkpoint.tree.get("names")
    if names is None:
        if config.task.command:
            raise ExportError(
                f"checkpoint of round {checkpoint.commit.round} records no parameter names (an "
                f"older release wrote it) and the run's model is built by its own command: "
                f"export a checkpoint this release wrote"
            )
        model = _task(config).model
        names = stored_names(model, split_fragments(model, config.diloco.fragments))
    try:
        return GlobalWeights(*named_weights(fragments, names))
    except NamesError as exc:
        raise ExportError(f"checkpoint of round {checkpoint.commit.round}: {exc}") from None


def _task(config: RunConfig) -> Task:
    """The run's task on CPU, its data the run's (read only if it is evaluated)."""
    context = replace(task_context(config, 0, SINGLE_PROCESS), device=torch.device("cpu"))
    return build_task(config.task.entrypoint, context)


def trained_task(config: RunConfig, weights: GlobalWeights) -> Task:
    """The run's task (``[task] entrypoint``), built on CPU, its model holding ``weights``
    (read into its own tensors): what its ``save`` hook writes from."""
    task = _task(config)
    state, given = task.model.state_dict(keep_vars=True), weights.by_every_name()
    parameters = {name for name, _ in task.model.named_parameters(remove_duplicate=False)}
    if wrong := sorted(parameters - given.keys()) + sorted(given.keys() - state.keys()):
        raise ExportError(f"the task's model and the checkpoint's weights differ in {wrong[0]}: "
                          f"the task differs from the run's")  # fmt: skip
    for name, tensor in given.items():
        if (state[name].shape, state[name].dtype) != (tensor.shape, tensor.dtype):
            raise ExportError(
                f"the task's model does not take the checkpoint's weights: {name} is "
                f"{state[name].dtype} {list(state[name].shape)} there, {tensor.dtype} "
                f"{list(tensor.shape)} in the checkpoint; the task differs from the run's"
            )
        with torch.no_grad():
            fill_from(state[name].data, tensor)
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
        f"({_builder(config)} builds the model).\n"
    )


def _builder(config: RunConfig) -> str:
    """What builds the model: the run's own script (``[task] command``), else its task."""
    if config.task.command:
        return f"the run's script, `{shlex.join(config.task.command)}`,"
    return f"the task `{config.task.entrypoint}`"


def _files(
    config: RunConfig, checkpoint: Checkpoint, summary: RunSummary, added: dict[str, bytes]
) -> dict[str, bytes]:
    """The export's files besides the weights: the card, run.toml, the files the script
    ``added`` (``export_files.py``) and the task's own format."""
    files = {
        **added,
        CARD_FILE: model_card(config, checkpoint, summary).encode(),
        CONFIG_FILE: config_text(config),
    }  # fmt: skip
    if not config.task.command:  # a task of the run's own may add its format
        files.update(_saved_files(trained_task(config, global_weights(config, checkpoint))))
    return files


def _saved_files(task: Task) -> dict[str, bytes]:
    """What the task's ``save`` hook writes (none without one), under ``saved/``."""
    if task.save is None:
        return {}
    files = {}
    with tempfile.TemporaryDirectory() as folder:
        task.save(task.model, Path(folder))
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                files[f"{SAVED_FOLDER}/{path.relative_to(folder).as_posix()}"] = path.read_bytes()
    return files


def weight_shards(weights: GlobalWeights, shard_bytes: int = SHARD_BYTES) -> list[list[str]]:
    """The stored names, in order, in runs of at most ``shard_bytes`` (a tensor larger than
    that is a run of its own): the files the weights are written in."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in weights.tensors.items():
        length = tensor.numel() * tensor.dtype.itemsize
        if shards[-1] and size + length > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += length
    return shards


def write_weights(store: Store, weights: GlobalWeights, shard_bytes: int = SHARD_BYTES) -> None:
    """The global weights as safetensors: ``model.safetensors`` when they fit one shard,
    else shards and their index, as transformers' ``save_pretrained`` writes a large model.
    Each tensor tied to several names (a head sharing the embedding's weight, GPT-2 style) is
    stored once, the other names in its file's metadata as safetensors' ``save_model``
    records them (``{name: stored name}``): ``load_model``, or a model's ``load_state_dict``
    then ``tie_weights``, or ``from_pretrained``, tie them back. ``format: pt`` as
    ``save_pretrained`` writes it, which ``from_pretrained`` checks (in transformers 4) once a
    file has metadata. A shard's tensors are read into memory while it is written, one shard
    at a time; the same weights give the same bytes (``ordered_metadata``), so a second export
    of a checkpoint is a no-op."""
    shards = weight_shards(weights, shard_bytes)
    names = [MODEL_FILE] if len(shards) == 1 else [
        f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))
    ]  # fmt: skip
    for name, stored in zip(names, shards, strict=True):
        tied = {alias: to for alias, to in weights.tied.items() if to in stored}
        tensors = {key: _loaded(weights.tensors[key]) for key in stored}
        path = store.spool(name)
        try:
            save_file(tensors, path, metadata={"format": "pt", **tied})
            del tensors
            order_metadata_in_file(path)
            store.put_file(name, path)
        finally:
            Path(path).unlink(missing_ok=True)
    if len(shards) > 1:
        total = sum(t.numel() * t.dtype.itemsize for t in weights.tensors.values())
        where = {key: name for name, stored in zip(names, shards, strict=True) for key in stored}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(where.items()))}
        store.put(INDEX_FILE, json.dumps(index, indent=2).encode())


def _loaded(tensor: Any) -> torch.Tensor:
    """A checkpoint tensor read into memory (a tensor already is)."""
    return tensor.contiguous() if isinstance(tensor, torch.Tensor) else tensor.load()


def order_metadata_in_file(path: str) -> None:
    """The safetensors file at ``path`` with its header's metadata in sorted order.
    safetensors writes the metadata from a Rust ``HashMap``, whose order changes from one
    save to the next; the header is compact JSON (the tensors in a fixed order) padded to a
    multiple of 8 bytes, so sorting the metadata keeps its length and every data offset."""
    with open(path, "r+b") as file:
        size = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(size))
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > size:  # not the compact JSON described above: keep safetensors' own
            return
        file.seek(8)
        file.write(text.ljust(size))


def _write(store: Store, files: dict[str, bytes]) -> None:
    """Every file, create-only: a folder is a local store, so a second export of the same
    checkpoint is a no-op there too, and of another one an error."""
    store.put_many(files)


def export(config: RunConfig, destination: str, round_: int | None = None) -> Checkpoint:
    """Write the run's global weights at ``round_`` (default: the newest committed checkpoint)
    to ``destination``; the checkpoint it exported (its tensors no longer readable)."""
    layout = RunLayout(config.run.name)
    with Store(config.store_url()) as store:
        checkpoint = committed_checkpoint(store, layout, round_)
        try:
            summary = summarize(MetricsReader(store, layout).read())
            try:
                added = read_export_files(store, layout)
            except ExportFileError as exc:
                raise ExportError(f"{exc}: delete it, or the run's export folder") from None
            with Store(destination) as target:
                try:
                    write_weights(target, global_weights(config, checkpoint))
                    _write(target, _files(config, checkpoint, summary, added))
                except FileExistsError as exc:
                    raise ExportError(f"{exc}: export to an empty folder") from None
        finally:
            checkpoint.close()
    return checkpoint
