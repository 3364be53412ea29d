"""The run's initial model, decided by its replicas' votes (``bucket/agreement.py``): a replica
whose model differs (other initial weights, another structure) stops at once, naming the first
tensor that differs, the replicas holding the run's model and the likely cause of that kind of
difference, instead of sealing rounds nobody else's fingerprint matches until its syncs time
out (about 50 minutes at the default timeout). Seeding per rank, as DDP scripts often do, is
the usual cause of other values; another config or tokenizer of other shapes.

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

from diloco_anywhere.bucket.agreement import Electorate, agree
from diloco_anywhere.bucket.format.framing import Count
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.format.record import Record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.training.mistakes import ModelUnlikeRunError
from diloco_anywhere.training.state.global_state import local_tensor
from diloco_anywhere.training.state.parameter_names import parameter_name


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


def check_initial_state(
    store: Store, layout: RunLayout, model: nn.Module, electorate: Electorate
) -> None:
    """Vote for ``model``'s parameters as the run's initial model (``bucket/agreement.py``),
    and refuse it if the run's is another."""
    mine, key = describe(model), layout.initial_state()
    agreed = agree(store, key, mine, electorate)
    difference = first_difference(mine, agreed.record)
    if difference is not None:
        problem, cause = difference
        raise ModelUnlikeRunError(
            f"this replica's model is unlike the run's ({key}, {agreed.named()}): {problem}. "
            f"{cause}"
        )


SEEDING = ("Every replica must start from the same weights: seed the model the same on every "
           "replica (not per rank or per replica), or start it from a file with [task] "
           "init_from")  # fmt: skip
ARCHITECTURE = ("Another architecture: every replica must build the same model class with the "
                "same config (layers, hidden size, vocabulary)")  # fmt: skip
SIZE = ("Another model size or config (hidden size, layers, heads), or another tokenizer "
        "(its vocabulary sizes the embeddings): every replica needs the same")  # fmt: skip
DTYPE = ("The model was loaded or cast in another dtype (torch_dtype=, .half(), .to(...)): "
         "keep the parameters in one dtype on every replica; autocast does the rest")  # fmt: skip


def first_difference(mine: InitialState, theirs: InitialState) -> tuple[str, str] | None:
    """The first parameter, in order, that differs in name, shape, dtype or values, and the
    likely cause of that kind of difference."""
    for index, (a, b) in enumerate(zip(mine.tensors, theirs.tensors, strict=False)):
        if a.name != b.name:
            return f"parameter {index} is {a.name} here, {b.name} in the run", ARCHITECTURE
        if a.shape != b.shape:
            return (f"{a.name} is {a.dtype} {list(a.shape)} here, {b.dtype} {list(b.shape)} in "
                    f"the run", SIZE)  # fmt: skip
        if a.dtype != b.dtype:
            return (f"{a.name} is {a.dtype} {list(a.shape)} here, {b.dtype} {list(b.shape)} in "
                    f"the run", DTYPE)  # fmt: skip
        if a.crc32c != b.crc32c:
            return f"{a.name} {list(a.shape)} holds other initial values than the run's", SEEDING
    if len(mine.tensors) != len(theirs.tensors):
        return (f"{len(mine.tensors)} parameters here, {len(theirs.tensors)} in the run's "
                f"model", ARCHITECTURE)  # fmt: skip
    return None
