"""A replica's global state as torchft's DiLoCo keeps it, as one tree: read, fingerprint, replay.

DiLoCo keeps, per fragment, the global weights (``original_parameters``, the weights every
replica agreed on at the fragment's last sync) and the outer optimizer's state, and registers a
save and a load function for them with the manager (``StreamingDiLoCoFragment_{i}``). Together
with the manager's counters that is everything replicas must hold identically; the inner
optimizer and the local weights are each replica's own (arXiv 2311.08105 algorithm 1).

``replay`` applies one committed round the way ``_StreamingDiLoCoFragment.perform_sync`` does
(restore the global weights, set the averaged pseudo-gradient as the gradient, step the outer
optimizer, keep the result as the new global weights), so a replica that replays the rounds it
missed holds the same bits as the replicas that lived through them.

In a sharded replica (FSDP2) the parameters are DTensors and each rank holds its local shard
of them: DiLoCo keeps only the local shards of the global weights, and the outer optimizer's
momentum is a DTensor like its parameter. Everything here works on the local shards, exactly
as torchft's ``local_sgd.py`` does (``extract_local_tensor``, ``DTensor.from_local``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import crc32c
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils import _pytree as pytree

FRAGMENT_KEY = "StreamingDiLoCoFragment_{}"  # torchft's key for fragment i's state functions


@dataclass(frozen=True, eq=False)  # its tensor has no truth value: compare fields yourself
class LocalShard:
    """One rank's part of a DTensor, copied off it (what a checkpoint stores of it): the local
    tensor, and where it sits in the whole, as data (never a pickled mesh or placement)."""

    tensor: torch.Tensor
    shape: tuple[int, ...]  # the whole tensor's
    offset: tuple[int, ...]  # of the local tensor in the whole
    mesh: tuple[int, ...]  # the device mesh's shape
    placements: tuple[str, ...]  # e.g. ("Shard(dim=0)",)

    @classmethod
    def of(cls, tensor: DTensor) -> LocalShard:
        """A CPU copy of ``tensor``'s local shard and its place."""
        return cls.like(tensor.to_local(), tensor)

    @classmethod
    def like(cls, local: torch.Tensor, tensor: DTensor) -> LocalShard:
        """A CPU copy of ``local``, which is placed as ``tensor``'s local shard (DiLoCo keeps a
        DTensor parameter's global weights as its local shard)."""
        return cls.placed(local.detach().to("cpu", copy=True), tensor)

    @classmethod
    def placed(cls, local: torch.Tensor, tensor: DTensor) -> LocalShard:
        """``local`` itself (not a copy), placed as ``tensor``'s local shard."""
        return cls(local, *placement(tensor))

    def place(self) -> tuple[tuple[int, ...], ...]:
        """Where it sits: the whole shape, the offset, the mesh and the placements."""
        return self.shape, self.offset, self.mesh, self.placements


def placement(tensor: DTensor) -> tuple[tuple[Any, ...], ...]:
    """Where this rank's shard of ``tensor`` sits: the whole shape, its offset in it, the
    device mesh's shape and the placements (``compute_local_shape_and_global_offset`` is
    what torch's distributed checkpoint uses for the same)."""
    _, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return (
        tuple(tensor.shape), tuple(offset), tuple(tensor.device_mesh.shape),
        tuple(str(p) for p in tensor.placements),
    )  # fmt: skip


def local_tensor(leaf: Any) -> Any:
    """A DTensor's (or a ``LocalShard``'s) local tensor; any other leaf as it is."""
    if isinstance(leaf, DTensor):
        return leaf.to_local()
    return leaf.tensor if isinstance(leaf, LocalShard) else leaf


CHECKSUM_BYTES = 16 << 20  # a device tensor is checksummed this many bytes at a time


def tree_checksum(tree: Any) -> int:
    """CRC32C over the bytes of every tensor leaf (a rank's local shard of a DTensor), in
    flattening order: equal trees give equal checksums on every device, whatever the thread
    count. A host tensor is read where it is; a device one a slice of ``CHECKSUM_BYTES`` at a
    time, so no copy of the state is made."""
    checksum = 0
    for leaf in map(local_tensor, pytree.tree_leaves(tree)):
        if isinstance(leaf, torch.Tensor):
            data = leaf.detach().contiguous().reshape(-1).view(torch.uint8)
            for start in range(0, data.numel(), CHECKSUM_BYTES):
                chunk = data[start : start + CHECKSUM_BYTES].cpu().numpy()
                checksum = crc32c.crc32c(chunk, checksum)
        elif is_tensor_like(leaf):  # a checkpoint's tensor not read yet: it reads its bytes
            checksum = leaf.checksum(checksum)
    return checksum


def is_tensor_like(leaf: Any) -> bool:
    """A tensor, or a checkpoint's tensor read when asked (``checkpoints/reader.TensorRef``,
    ``tree.JoinedRef``): what has a shape and a dtype and can ``fill`` a tensor."""
    return isinstance(leaf, torch.Tensor) or (hasattr(leaf, "fill") and hasattr(leaf, "dtype"))


def fill_from(destination: torch.Tensor, source: Any) -> None:
    """``source`` (a tensor, or a checkpoint's tensor read when asked) into ``destination``."""
    if isinstance(source, torch.Tensor):
        destination.copy_(source)
    else:
        source.fill(destination)


def _as_parameter(values: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """``values`` (a local shard, or the whole tensor) as ``parameter`` holds it: a DTensor
    parameter's local shard is wrapped as torchft's ``restore_parameters`` and ``_set_grads``
    wrap it."""
    values = values.to(local_tensor(parameter).device)
    if not isinstance(parameter, DTensor):
        return values
    return DTensor.from_local(
        values, parameter.device_mesh, parameter.placements,
        shape=parameter.shape, stride=parameter.stride(),
    )  # fmt: skip


def _outer_step(optimizer: torch.optim.Optimizer, parameter: Any, weights: torch.Tensor) -> None:
    """``optimizer``'s step on ``parameter`` from ``weights`` (updated), the mean it holds as
    the gradient. A plain parameter on the weights' device steps on DiLoCo's own tensor, its
    storage swapped for the step and put back: nothing is copied. A DTensor's storage belongs
    to FSDP, which must keep it: the mean is cloned and the weights copied in and back."""
    if isinstance(parameter, DTensor) or parameter.device != weights.device:
        parameter.grad = _as_parameter(local_tensor(parameter.data).clone(), parameter)
        parameter.data.copy_(_as_parameter(weights, parameter))
        optimizer.step()
        optimizer.zero_grad()
        weights.copy_(local_tensor(parameter.data))
        return
    mean = parameter.data
    parameter.data, parameter.grad = weights, mean
    try:
        optimizer.step()
    finally:
        optimizer.zero_grad()
        parameter.data = mean


def _outer_state_as_parameters(
    optimizer: torch.optim.Optimizer, saved: dict[str, Any]
) -> dict[str, Any]:
    """An outer optimizer's saved state with each per-parameter tensor of a DTensor
    parameter's local shape (momentum) wrapped as that parameter: a checkpoint stores local
    shards, and torch's SGD adds DTensor gradients to its buffers."""
    parameters = [p for group in optimizer.param_groups for p in group["params"]]

    def wrap(index: Any, value: Any) -> Any:
        parameter = (
            parameters[index] if isinstance(index, int) and index < len(parameters) else None
        )
        fits = (
            isinstance(parameter, DTensor)
            and isinstance(value, torch.Tensor)
            and not isinstance(value, DTensor)
            and value.shape == parameter.to_local().shape
        )
        return _as_parameter(value, parameter) if fits else value  # type: ignore[arg-type]

    state = {
        index: {name: wrap(index, value) for name, value in values.items()}
        for index, values in saved.get("state", {}).items()
    }
    return {**saved, "state": state}


def _filled_outer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """An outer optimizer's saved state with each checkpoint tensor (``TensorRef``) filled into
    the tensor it becomes: the optimizer's own for that parameter where it has one of its
    shape (a replica that synced before), else a new one on the parameter's device (a step
    count on the CPU, as torch keeps it)."""
    parameters = [local_tensor(p) for group in optimizer.param_groups for p in group["params"]]
    own = [optimizer.state.get(p, {}) for group in optimizer.param_groups for p in group["params"]]

    def filled(index: int, name: str, value: Any) -> Any:
        if isinstance(value, torch.Tensor) or not is_tensor_like(value):
            return value
        mine = local_tensor(own[index].get(name)) if index < len(own) else None
        if isinstance(mine, torch.Tensor) and _like(mine, value):
            return value.fill(mine)
        device = parameters[index].device if value.dim() else torch.device("cpu")
        return value.load(device)

    state = {
        index: {name: filled(index, name, value) for name, value in values.items()}
        for index, values in saved.get("state", {}).items()
    }
    return {**saved, "state": state}


def state_tree(state_dict_fns: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    """Every registered state (DiLoCo's: one per fragment) by key, in sorted key order: the
    order fingerprints and checkpoints see, the same on every replica."""
    return {key: state_dict_fns[key][1]() for key in sorted(state_dict_fns)}


class GlobalState:
    """The global part of one replica's training: DiLoCo's per-fragment state (through the
    functions it registered with ``manager``), the model fragments and their outer optimizers."""

    def __init__(
        self,
        state_dict_fns: dict[str, tuple[Any, Any]],
        fragments: list[nn.Module],
        outer_optimizers: list[torch.optim.Optimizer],
        names: dict[str, Any],
        originals: list[dict[str, torch.Tensor]],
    ) -> None:
        """``names``: the model's names of the fragments' weights, which checkpoints record
        (``parameter_names.stored_names``). ``originals``: each fragment's global weights, the
        tensors DiLoCo keeps them in (its ``original_parameters``), read and written in place:
        torchft's save function clones every one of them, a copy of the model per call."""
        self._fns = state_dict_fns
        self.fragments, self.outer_optimizers = fragments, outer_optimizers
        self.names, self.originals = names, originals

    def fragments_tree(self) -> dict[str, Any]:
        """Each fragment's state as DiLoCo keeps it: its global weights and its outer
        optimizer's state, by reference (nothing is copied), in the order of its key."""
        pairs = zip(self.originals, self.outer_optimizers, strict=True)
        tree = {
            FRAGMENT_KEY.format(index): {
                "outer_optimizer": optimizer.state_dict(), "original_parameters": dict(weights)
            }
            for index, (weights, optimizer) in enumerate(pairs)
        }  # fmt: skip
        return {key: tree[key] for key in sorted(tree)}

    def checkpoint_tree(self) -> dict[str, Any]:
        """``fragments_tree`` as a checkpoint stores it: a sharded replica's global weights as
        ``LocalShard``s placed as their parameters (their momentum is a DTensor already), all
        by reference."""
        tree = self.fragments_tree()
        for index, fragment in enumerate(self.fragments):
            key = FRAGMENT_KEY.format(index)
            parameters = dict(fragment.named_parameters())
            weights = {
                name: LocalShard.placed(value, parameters[name])
                if isinstance(parameters.get(name), DTensor)
                else value
                for name, value in tree[key]["original_parameters"].items()
            }
            tree[key] = {**tree[key], "original_parameters": weights}
        return tree

    def load_fragments_tree(self, tree: dict[str, Any]) -> None:
        """Load a saved state (a checkpoint's, or the leader's), checked first against this
        replica's fragments and outer optimizers, and its hyperparameters after (torch fills
        in the ones a state of another release lacks); ``ValueError`` naming what differs.
        Checked because neither loader does: torchft's copies a weight of another shape by
        broadcasting and keeps a weight the state lacks, and torch's optimizer takes momentum
        of any shape, which then fails the outer step halfway through a replay."""
        self._check_fits(tree)
        tree = pytree.tree_map(local_tensor, tree)  # a checkpoint's LocalShards
        before = [[dict(group) for group in o.param_groups] for o in self.outer_optimizers]
        for index, optimizer in enumerate(self.outer_optimizers):
            fragment = tree[FRAGMENT_KEY.format(index)]
            with torch.no_grad():  # into DiLoCo's own tensors, as its load function copies
                for name, weights in fragment["original_parameters"].items():
                    fill_from(self.originals[index][name], weights)
            saved = _filled_outer_state(optimizer, fragment["outer_optimizer"])
            optimizer.load_state_dict(_outer_state_as_parameters(optimizer, saved))
        for index, optimizer in enumerate(self.outer_optimizers):
            _check_hyperparameters(FRAGMENT_KEY.format(index), optimizer, before[index])

    def _check_fits(self, tree: Any) -> None:
        """The state holds this replica's fragments, each with every global weight of its
        parameter's (local) shape and dtype, sitting where this rank's shard of it does, and
        its outer optimizer's state laid out as this optimizer's."""
        if not (isinstance(tree, dict) and tree.keys() == self._fns.keys()):
            found = sorted(map(str, tree)) if isinstance(tree, dict) else type(tree).__name__
            raise ValueError(f"state has {found}; this replica has {sorted(self._fns)}")
        pairs = zip(self.fragments, self.outer_optimizers, strict=True)
        for index, (fragment, optimizer) in enumerate(pairs):
            key = FRAGMENT_KEY.format(index)
            saved = tree[key]
            if not (isinstance(saved, dict) and isinstance(saved.get("original_parameters"), dict)):
                raise ValueError(f"{key}: the state holds no original_parameters")
            check_weights(key, saved["original_parameters"], dict(fragment.named_parameters()))
            check_optimizer_state(key, saved.get("outer_optimizer"), optimizer)

    def checksum(self) -> int:
        return tree_checksum(self.fragments_tree())

    def global_weights(self, fragment: int) -> dict[str, torch.Tensor]:
        """``fragment``'s global weights: DiLoCo's own tensors (not copies)."""
        return self.originals[fragment]

    def replay_buffers(self, fragment: int) -> list[torch.Tensor]:
        """Where a round replayed on ``fragment`` is read into (``collective.observe``): its
        parameters (their local shards), in ``named_parameters`` order, as DiLoCo sends them.
        A healing replica needs nothing they hold: they are set to the global weights after."""
        return [local_tensor(p.data) for _, p in self.fragments[fragment].named_parameters()]

    def replay(self, fragment: int) -> None:
        """Apply one committed round's averaged pseudo-gradient, which ``fragment``'s
        parameters hold (``replay_buffers``), as ``perform_sync`` does: each parameter takes
        its global weights, the mean as its gradient, and the outer optimizer's step, one
        parameter at a time (SGD updates each parameter and its momentum from its own gradient
        alone: the same bits as one step over all), so a replay holds one tensor's copy at a
        time at most, not the model's (``_outer_step``)."""
        weights = self.global_weights(fragment)
        optimizer = self.outer_optimizers[fragment]
        with torch.no_grad():
            for name, parameter in self.fragments[fragment].named_parameters():
                _outer_step(optimizer, parameter, weights[name])

    def reset_local_weights(self) -> None:
        """Every parameter back to the global weights: a healed replica starts its inner steps
        from where the others are."""
        self._put_weights([self.global_weights(index) for index in range(len(self.fragments))])

    @contextmanager
    def global_weights_in_place(self) -> Iterator[None]:
        """The model holds every fragment's global weights inside the block, and its own local
        weights again after it, bit for bit (they wait in host memory meanwhile).

        Streaming DiLoCo (arXiv 2501.18512 section 2) syncs one fragment at a time, so at any
        sync only that fragment's parameters are the agreed weights; the others have trained
        on locally since their own sync. Evaluating the model as it stands would measure a mix
        no replica agreed on, and one that differs from replica to replica."""
        local = [
            {
                name: local_tensor(parameter.data).detach().to("cpu", copy=True)
                for name, parameter in fragment.named_parameters()
            }
            for fragment in self.fragments
        ]
        self.reset_local_weights()
        try:
            yield
        finally:
            self._put_weights(local)

    def _put_weights(self, weights: list[dict[str, torch.Tensor]]) -> None:
        """Each fragment's parameters set to its ``weights`` (whole tensors, or this rank's
        local shards of DTensor parameters), by name."""
        with torch.no_grad():
            for fragment, values in zip(self.fragments, weights, strict=True):
                for name, parameter in fragment.named_parameters():
                    parameter.data.copy_(_as_parameter(values[name], parameter))


def check_weights(
    key: str, saved: dict[Any, Any], parameters: dict[str, torch.Tensor], of: str = "fragment"
) -> None:
    """Every parameter's global weights (or every tensor of ``of``'s), and no others: a tensor
    of its local shard's shape and dtype (a ``LocalShard`` sitting where this rank's shard
    does)."""
    if saved.keys() != parameters.keys():
        raise ValueError(f"{key}: the state's weights are {sorted(map(str, saved))[:5]}...; "
                         f"this {of}'s {sorted(parameters)[:5]}...")  # fmt: skip
    for name, parameter in parameters.items():
        leaf, local = saved[name], local_tensor(parameter)
        found = local_tensor(leaf)
        if not (is_tensor_like(found) and _like(found, local)):
            what = _describe(found) if is_tensor_like(found) else type(found).__name__
            raise ValueError(f"{key}: weights {name} are {what}; the parameter's "
                             f"{_describe(local)}")  # fmt: skip
        sharded = isinstance(leaf, LocalShard) and isinstance(parameter, DTensor)
        if sharded and leaf.place() != placement(parameter):
            raise ValueError(
                f"the checkpoint's shard of {name} sits at {leaf.place()}; this rank's is at "
                f"{placement(parameter)} (shape, offset, mesh, placements)"
            )


def _like(tensor: torch.Tensor, parameter: torch.Tensor) -> bool:
    return tensor.shape == parameter.shape and tensor.dtype == parameter.dtype


def _describe(tensor: torch.Tensor) -> str:
    return f"{list(tensor.shape)} {tensor.dtype}"


def check_optimizer_state(
    key: str,
    saved: Any,
    optimizer: torch.optim.Optimizer,
    what: str = "outer optimizer",
    names: list[str] | None = None,
) -> None:
    """An optimizer's state as torch's ``state_dict`` writes this optimizer's: one group per
    group, numbering the parameters 0, 1, ... in order (torch matches state to parameters by
    that number), and per parameter a dict whose tensors are scalars (a step count) or of the
    parameter's local shape (SGD's momentum, Adam's moments): torch's ``load_state_dict``
    takes any shape, which then fails a step halfway. ``what`` names the optimizer in the
    errors, ``names`` its parameters (by number)."""
    parameters = [local_tensor(p) for group in optimizer.param_groups for p in group["params"]]
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    state = saved.get("state") if isinstance(saved, dict) else None
    numbers = iter(range(len(parameters)))
    expected = [[next(numbers) for _ in group["params"]] for group in optimizer.param_groups]
    groups = groups if isinstance(groups, list) else []
    found = [group.get("params") if isinstance(group, dict) else group for group in groups]
    if not (
        isinstance(state, dict)
        and found == expected
        and all(type(number) is int for group in found for number in group)
    ):
        raise ValueError(f"{key}: the {what}'s state numbers its parameters "
                         f"{str(found)[:80]}; this optimizer, {str(expected)[:80]}")  # fmt: skip
    for number, values in state.items():
        if not (type(number) is int and 0 <= number < len(parameters) and isinstance(values, dict)):
            raise ValueError(f"{key}: the {what}'s state names {number!r:.40}, not one "
                             f"of its {len(parameters)} parameters")  # fmt: skip
        shape = parameters[number].shape
        label = f"parameter {number}" + (f" ({names[number]})" if names else "")
        for name, value in values.items():
            value = local_tensor(value)
            if is_tensor_like(value) and value.dim() and value.shape != shape:
                raise ValueError(f"{key}: the {what}'s {name} of {label} is "
                                 f"{list(value.shape)}; allowed: a scalar, or "
                                 f"{list(shape)} as the parameter")  # fmt: skip


def _kind(value: Any) -> str:
    """What a hyperparameter is, as far as an optimizer's step cares."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "finite number" if math.isfinite(value) else "number that is not finite"
    return type(value).__name__


def _check_hyperparameters(
    key: str, optimizer: torch.optim.Optimizer, before: list[dict[str, Any]]
) -> None:
    """Each group's hyperparameters after a load are the kinds they were before it (a number,
    a flag, None): an outer step with an ``lr`` of another kind fails halfway through."""
    for group, old in zip(optimizer.param_groups, before, strict=True):
        for name, value in old.items():
            loaded = group.get(name)
            if name != "params" and _kind(loaded) != _kind(value):
                raise ValueError(f"{key}: the outer optimizer's {name} is {loaded!r:.40}; "
                                 f"allowed: a {_kind(value)}, as this optimizer's")  # fmt: skip
