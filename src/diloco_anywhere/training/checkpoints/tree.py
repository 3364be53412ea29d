"""A state tree as named tensors and a structure, and back: how a checkpoint holds the run's
global state without pickling it.

The tensors are named by their path in the tree, so any safetensors reader can take the run's
weights out of the bucket; the structure (dict, list, tuple, tensor and value nodes, the other
leaves as JSON) is this module's own small format, because a checkpoint is bucket data, which
must never choose code to run. A DTensor goes in as its ``LocalShard`` (its whole shape,
offset, mesh and placements recorded as data), and the ranks' parts of a sharded checkpoint
come back as one tree (``whole_tree``). This is torchft's PGTransport idea (a state dict
flattened to metadata plus tensors) with the bucket as the wire. Only trees and bytes here: the
writer and the reader do the store's side.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from diloco_anywhere.bucket.format.layout import MAX_COUNT
from diloco_anywhere.training.checkpoints.records import CheckpointError
from diloco_anywhere.training.state.global_state import LocalShard, fill_from

JSON_LEAVES = (bool, int, float, str, type(None))


def _name(path: tuple[str | int, ...]) -> str:
    return "".join(f"[{key!r}]" for key in path)


def _encode(node: Any, path: tuple[str | int, ...], tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, DTensor):  # its local shard, by reference, placed as data
        node = LocalShard.placed(node.to_local(), node)
    if isinstance(node, torch.Tensor):
        tensors[_name(path)] = node.contiguous()
        return {"tensor": _name(path)}
    if isinstance(node, LocalShard):
        tensors[_name(path)] = node.tensor.contiguous()
        return {"dtensor": {
            "tensor": _name(path), "shape": list(node.shape), "offset": list(node.offset),
            "mesh": list(node.mesh), "placements": list(node.placements),
        }}  # fmt: skip
    if isinstance(node, dict):
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in node):
            raise TypeError(f"state node {_name(path)} has keys other than str and int")
        return {"dict": [[k, _encode(v, (*path, k), tensors)] for k, v in node.items()]}
    if isinstance(node, (list, tuple)):
        kind = "list" if isinstance(node, list) else "tuple"
        return {kind: [_encode(v, (*path, i), tensors) for i, v in enumerate(node)]}
    if isinstance(node, JSON_LEAVES):
        return {"value": node}
    raise TypeError(
        f"state leaf {_name(path)} is a {type(node).__name__}: only tensors, JSON scalars, "
        f"and dicts, lists and tuples of them go into a checkpoint"
    )


def flatten(tree: Any) -> tuple[dict[str, torch.Tensor], bytes]:
    """The tensors by path name (the tree's own, not copies), and the structure with the
    other leaves as JSON.

    The structure is this module's own small format (dict, list, tuple, tensor, value nodes),
    not torch's pytree spec: ``treespec_loads`` imports modules named in its input, and a
    checkpoint is bucket data, which must never choose code to run."""
    tensors: dict[str, torch.Tensor] = {}
    structure = _encode(tree, (), tensors)
    return tensors, json.dumps(structure).encode()


def _decode(node: Any, tensors: dict[str, torch.Tensor], used: set[str]) -> Any:
    if not (isinstance(node, dict) and len(node) == 1):
        raise ValueError(f"a node must be an object with one field, not {str(node)[:80]}")
    ((kind, value),) = node.items()
    if kind == "tensor" and isinstance(value, str) and value in tensors:
        used.add(value)
        return tensors[value]
    if kind == "dtensor" and isinstance(value, dict) and value.get("tensor") in tensors:
        used.add(value["tensor"])
        return _local_shard(value, tensors[value["tensor"]])
    if kind == "value" and isinstance(value, JSON_LEAVES):
        return value
    if kind in ("list", "tuple") and isinstance(value, list):
        items = [_decode(item, tensors, used) for item in value]
        return items if kind == "list" else tuple(items)
    if kind == "dict" and isinstance(value, list):
        pairs = [pair for pair in value if isinstance(pair, list) and len(pair) == 2]
        keys = [pair[0] for pair in pairs]
        if len(pairs) != len(value) or not all(
            isinstance(k, (str, int)) and not isinstance(k, bool) for k in keys
        ):
            raise ValueError("a dict node must be [key, node] pairs with str or int keys")
        return {k: _decode(v, tensors, used) for k, v in pairs}
    raise ValueError(f"node {kind!r} with {str(value)[:80]} is not a tensor, value, list, tuple "
                     f"or dict node (or names a tensor the shards lack)")  # fmt: skip


def _local_shard(node: dict[str, Any], tensor: torch.Tensor) -> LocalShard:
    """A ``dtensor`` node's shard, its place checked: whole numbers, the local tensor inside
    the whole one."""
    fields = {name: node.get(name) for name in ("shape", "offset", "mesh")}
    if (
        not all(
            isinstance(v, list) and all(type(n) is int and 0 <= n <= MAX_COUNT for n in v)
            for v in fields.values()
        )
        or len(fields["shape"]) != tensor.dim()
        or len(fields["offset"]) != tensor.dim()
    ):
        raise ValueError(f"dtensor node {node.get('tensor')}: shape, offset and mesh must be "
                         f"lists of whole numbers, one per dimension")  # fmt: skip
    ends = [o + n for o, n in zip(fields["offset"], tensor.shape, strict=True)]
    if any(end > whole for end, whole in zip(ends, fields["shape"], strict=True)):
        raise ValueError(f"dtensor node {node['tensor']}: the local shard at {fields['offset']} "
                         f"reaches past the whole shape {fields['shape']}")  # fmt: skip
    placements = node.get("placements")
    if not (
        isinstance(placements, list)
        and all(isinstance(p, str) for p in placements)
        and len(placements) == len(fields["mesh"])
        and all(fields["mesh"])
    ):
        raise ValueError(f"dtensor node {node['tensor']}: placements must be a list of strings, "
                         f"one per dimension of the mesh, whose sizes are at least 1")  # fmt: skip
    return LocalShard(
        tensor, tuple(fields["shape"]), tuple(fields["offset"]), tuple(fields["mesh"]),
        tuple(placements),
    )  # fmt: skip


def unflatten(structure: bytes, tensors: dict[str, torch.Tensor], key: str) -> Any:
    """The tree back from ``flatten``'s parts; ``CheckpointError`` naming ``key`` if they do not
    fit together (a tensor missing or extra, or a structure that does not parse)."""
    used: set[str] = set()
    try:
        parsed = json.loads(structure, parse_constant=_not_finite, parse_float=_finite)
        tree = _decode(parsed, tensors, used)
    except Exception as exc:  # bucket data: whatever it is, it is not a checkpoint to load
        raise CheckpointError(f"{key}: state structure does not parse: {exc}") from None
    if extra := sorted(tensors.keys() - used):
        raise CheckpointError(f"{key}: the shards hold tensors the structure lacks: {extra[:3]}")
    return tree


def _finite(text: str) -> float:
    """A JSON number of the structure, which must be finite: ``json`` reads ``1e999`` as inf."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is not finite; a checkpoint's values must be")
    return value


def _not_finite(text: str) -> float:
    """``NaN`` and ``Infinity``, which ``json`` accepts by default, are no checkpoint value."""
    raise ValueError(f"{text} is not finite; a checkpoint's values must be")


def plan_shards(tensors: dict[str, torch.Tensor], count: int) -> list[list[str]]:
    """Tensor names split into at most ``count`` runs of about equal bytes, in order."""
    names = list(tensors)
    count = max(1, min(count, len(names)))
    sizes = [tensors[name].numel() * tensors[name].element_size() for name in names]
    total, shards, done = sum(sizes), [[] for _ in range(count)], 0
    for name, size in zip(names, sizes, strict=True):
        shard = min(count - 1, done * count // max(total, 1))
        shards[shard].append(name)
        done += size
    return [shard for shard in shards if shard] or [[]]


# -- a sharded checkpoint's parts as one tree ---------------------------------------------


def whole_tree(parts: list[Any]) -> Any:
    """The state of a sharded checkpoint as one tree: each ``LocalShard`` leaf a
    ``JoinedRef`` that puts it together from the ranks' shards at their offsets (every element
    exactly once, checked now), every other leaf (counters, hyperparameters) the same in every
    part. One part (an unsharded checkpoint, a one-rank FSDP's) is the tree itself."""
    if len(parts) == 1:
        return tree_map(lambda leaf: JoinedRef((leaf,)) if isinstance(leaf, LocalShard) else leaf,
                        parts[0])  # fmt: skip

    def whole(*leaves: Any) -> Any:
        first = leaves[0]
        if isinstance(first, LocalShard):
            return JoinedRef(leaves)
        if any(not _same(leaf, first) for leaf in leaves):
            raise CheckpointError(f"the ranks' parts differ in an unsharded leaf: {first!r:.80}")
        return first

    return tree_map(whole, parts[0], *parts[1:])


class LazyTensor:
    """A checkpoint's tensor read when asked: its ``shape`` and ``dtype`` known from the
    bucket's headers, its values read by ``fill`` into a tensor of the caller's."""

    shape: torch.Size
    dtype: torch.dtype

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def fill(self, destination: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def load(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """A new tensor on ``device`` holding this one."""
        return self.fill(torch.empty(self.shape, dtype=self.dtype, device=device))


class JoinedRef(LazyTensor):
    """One tensor of a sharded checkpoint, from its ranks' ``LocalShard``s, each element
    covered exactly once (checked here, before anything the size of the whole is allocated:
    the shapes come from the bucket). ``fill`` and ``load`` copy each shard into its place
    (a shard's tensor is a tensor or a ``TensorRef``)."""

    def __init__(self, shards: tuple[Any, ...]) -> None:
        first = shards[0]
        kind = (first.shape, first.tensor.dtype)
        if not all(isinstance(s, LocalShard) and (s.shape, s.tensor.dtype) == kind for s in shards):
            raise CheckpointError("the ranks' parts hold one tensor in different shapes or dtypes")
        numel, held = math.prod(first.shape), sum(s.tensor.numel() for s in shards)
        if held != numel:
            raise CheckpointError(f"the ranks' shards of a {list(first.shape)} tensor hold "
                                  f"{held} elements, not {numel}")  # fmt: skip
        boxes = [_box(shard) for shard in shards]
        if any(_overlap(a, b) for k, a in enumerate(boxes) for b in boxes[k + 1 :]):
            raise CheckpointError(f"the ranks' shards of a {list(first.shape)} tensor overlap")
        self.shards, self.shape, self.dtype = shards, torch.Size(first.shape), first.tensor.dtype

    def fill(self, destination: torch.Tensor) -> torch.Tensor:
        for shard, box in zip(self.shards, map(_box, self.shards), strict=True):
            place = destination[tuple(slice(start, end) for start, end in box)]
            fill_from(place, shard.tensor)
        return destination


def _box(shard: LocalShard) -> list[tuple[int, int]]:
    return [(o, o + n) for o, n in zip(shard.offset, shard.tensor.shape, strict=True)]


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    """Whether two boxes share an element (every dimension's ranges intersect)."""
    return all(max(lo, low) < min(hi, high) for (lo, hi), (low, high) in zip(a, b, strict=True))


def _same(a: Any, b: Any) -> bool:
    """Two parts' copies of an unsharded leaf are one (a tensor's values read to compare)."""
    if hasattr(a, "load") and hasattr(b, "load"):
        a, b = a.load(), b.load()
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    return a == b
