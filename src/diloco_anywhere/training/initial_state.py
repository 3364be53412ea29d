"""The run's initial model, recorded by the first replica to start it: a replica whose model
differs (other initial weights, another structure) stops at once, naming the first tensor that
differs and the fix, instead of sealing rounds nobody else's fingerprint matches until its
syncs time out (about 50 minutes at the default timeout). Seeding per rank, as DDP scripts often
do, is the usual cause.

Checked only while the run has no committed checkpoint: once it has one, every replica heals
from it whatever it started with. Each parameter is recorded by name (a ``torch.compile``d
model's ``_orig_mod.`` prefix dropped), shape, dtype and the CRC32C of its bytes (its local
shard in a sharded replica, whose every rank records its own under its rank's layout).
"""

from __future__ import annotations

import crc32c
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from diloco_anywhere.bucket.first_written import first_written
from diloco_anywhere.bucket.framing import Count
from diloco_anywhere.bucket.layout import RunLayout
from diloco_anywhere.bucket.record import Record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.training.global_state import local_tensor
from diloco_anywhere.training.mistakes import ModelUnlikeRunError
from diloco_anywhere.training.parameter_names import parameter_name


class InitialTensor(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    name: str = Field(max_length=1000)
    shape: tuple[Count, ...] = Field(max_length=16)
    dtype: str = Field(max_length=32)
    crc32c: Count


class InitialState(Record):
    """A model's parameters as they were before its first inner step."""

    tensors: tuple[InitialTensor, ...] = Field(max_length=200_000)


def describe(model: nn.Module) -> InitialState:
    tensors = []
    for name, parameter in model.named_parameters():
        local = local_tensor(parameter.detach())
        data = local.reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
        tensors.append(InitialTensor(
            name=parameter_name(name), shape=tuple(local.shape),
            dtype=str(local.dtype).removeprefix("torch."), crc32c=crc32c.crc32c(data),
        ))  # fmt: skip
    return InitialState(tensors=tuple(tensors))


def check_initial_state(store: Store, layout: RunLayout, model: nn.Module) -> None:
    """Record ``model``'s parameters as the run's initial model if none is recorded yet
    (create-only; identical models write identical bytes), else refuse a model unlike it."""
    mine, key = describe(model), layout.initial_state()
    problem = first_difference(mine, first_written(store, key, mine))
    if problem is not None:
        raise ModelUnlikeRunError(
            f"this replica's model is unlike the run's ({key}): {problem}. Every replica must "
            f"start from the same weights: seed the model the same on every replica (not per "
            f"rank or per replica), or start it from a file with [task] init_from"
        )


def first_difference(mine: InitialState, theirs: InitialState) -> str | None:
    """The first parameter, in order, that differs in name, shape, dtype or values."""
    for index, (a, b) in enumerate(zip(mine.tensors, theirs.tensors, strict=False)):
        if a.name != b.name:
            return f"parameter {index} is {a.name} here, {b.name} in the run"
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            return (f"{a.name} is {a.dtype} {list(a.shape)} here, {b.dtype} {list(b.shape)} in "
                    f"the run")  # fmt: skip
        if a.crc32c != b.crc32c:
            return f"{a.name} {list(a.shape)} holds other initial values than the run's"
    if len(mine.tensors) != len(theirs.tensors):
        return f"{len(mine.tensors)} parameters here, {len(theirs.tensors)} in the run's model"
    return None
