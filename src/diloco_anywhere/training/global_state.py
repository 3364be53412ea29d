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
"""

from __future__ import annotations

from typing import Any

import crc32c
import torch
from torch import nn
from torch.utils import _pytree as pytree

FRAGMENT_KEY = "StreamingDiLoCoFragment_{}"  # torchft's key for fragment i's state functions


def tree_checksum(tree: Any) -> int:
    """CRC32C over the bytes of every tensor leaf, in flattening order: equal trees give equal
    checksums on every device, whatever the thread count."""
    checksum = 0
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            data = leaf.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
            checksum = crc32c.crc32c(data, checksum)
    return checksum


def state_tree(state_dict_fns: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    """Every registered state (DiLoCo's: one per fragment) by key, in sorted key order: the
    order fingerprints and checkpoints see, the same on every replica."""
    return {key: state_dict_fns[key][1]() for key in sorted(state_dict_fns)}


def fingerprint(step: int, checksum: int) -> str:
    """What every manifest carries: equal only for replicas holding the same global state."""
    return f"step-{step}-{checksum:08x}"


class GlobalState:
    """The global part of one replica's training: DiLoCo's per-fragment state (through the
    functions it registered with ``manager``), the model fragments and their outer optimizers."""

    def __init__(
        self,
        state_dict_fns: dict[str, tuple[Any, Any]],
        fragments: list[nn.Module],
        outer_optimizers: list[torch.optim.Optimizer],
    ) -> None:
        self._fns = state_dict_fns
        self.fragments, self.outer_optimizers = fragments, outer_optimizers

    def fragments_tree(self) -> dict[str, Any]:
        """Each fragment's saved state (references to DiLoCo's tensors, not copies)."""
        return state_tree(self._fns)

    def load_fragments_tree(self, tree: dict[str, Any]) -> None:
        if tree.keys() != self._fns.keys():
            raise ValueError(f"state has {sorted(tree)}; this replica has {sorted(self._fns)}")
        for key, (load, _) in self._fns.items():
            load(tree[key])

    def checksum(self) -> int:
        return tree_checksum(self.fragments_tree())

    def global_weights(self, fragment: int) -> dict[str, torch.Tensor]:
        """A copy (torchft's save function clones) of ``fragment``'s global weights."""
        return self._fns[FRAGMENT_KEY.format(fragment)][1]()["original_parameters"]

    def replay(self, fragment: int, mean: torch.Tensor) -> None:
        """Apply one committed round's averaged pseudo-gradient (flat float32, the fragment's
        parameters in ``named_parameters`` order, as DiLoCo sends them) to ``fragment``."""
        weights = self.global_weights(fragment)
        parameters = list(self.fragments[fragment].named_parameters())
        total = sum(p.numel() for _, p in parameters)
        if mean.numel() != total:
            raise ValueError(
                f"round result has {mean.numel()} values; fragment {fragment} has {total}"
            )
        offset = 0
        with torch.no_grad():
            for name, parameter in parameters:
                parameter.data.copy_(weights[name])
                values = mean[offset : offset + parameter.numel()].view(parameter.shape)
                parameter.grad = values.to(parameter.device, parameter.dtype)
                offset += parameter.numel()
        optimizer = self.outer_optimizers[fragment]
        optimizer.step()
        optimizer.zero_grad()
        load = self._fns[FRAGMENT_KEY.format(fragment)][0]  # copies into DiLoCo's own tensors
        load({
            "original_parameters": {name: parameter.data for name, parameter in parameters},
            "outer_optimizer": optimizer.state_dict(),
        })  # fmt: skip

    def reset_local_weights(self) -> None:
        """Every parameter back to the global weights: a healed replica starts its inner steps
        from where the others are."""
        with torch.no_grad():
            for index, fragment in enumerate(self.fragments):
                weights = self.global_weights(index)
                for name, parameter in fragment.named_parameters():
                    parameter.data.copy_(weights[name])
