"""torchtitan 0.3.0 on a CPU-only torch: what it needs that its wheel assumes a GPU for.

torchtitan is written for CUDA; this suite (and a user without a GPU, to try a job before
paying for one) runs it on the CPU with gloo. The changes, each where no extension point of
torchtitan reaches (docs/torchtitan.md, "On a CPU with torch 2.13.0"), none of them an edit of
the package and none applied where CUDA is present:

1. ``torchtitan.tools.utils`` binds ``device_type = _get_available_device_type() or "cuda"``
   at import: asked before that import, torch answers ``"cpu"`` here, with a device module
   carrying the memory calls torchtitan's metrics ask of ``torch.cuda``.
2. ``trainer.py`` imports a Triton kernel module (``distributed/minimal_async_ep/kernels.py``,
   a CUDA-only MoE path) at import; where Triton is absent that one module is a stand-in
   whose functions say so. Triton itself is not faked: torch probes for it.
3. ``torch.distributed.set_timeout`` (torchtitan 0.3.0 targets a newer torch) is torch
   2.13's ``distributed_c10d._set_pg_timeout``, the same signature.
4. gloo has no ``ReduceOp.PREMUL_SUM``, which FSDP2 picks for torchtitan's gradient divide
   factor of 1.0 (``distributed/fsdp.py``): a plain sum, the same numbers, is forced.
5. FlexAttention has no backward on the CPU: the job's attention modules compute the same
   masked attention with ``scaled_dot_product_attention`` and the dense mask of the
   FlexAttention block mask (``cpu_attention``).

Pinned to the torchtitan versions these were read from (``TESTED``): any other version is
refused at start, naming the versions tested, rather than half working.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch._utils
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 (torch's own spelling)
from torch.distributed import distributed_c10d

from diloco_anywhere import contract
from diloco_anywhere.training.mistakes import ScriptMistakeError

TESTED = ("0.3.0",)  # torchtitan versions the changes above were read from and tested with
KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
KERNEL_FUNCTIONS = (
    "copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel",
    "expand_topk_grad_kernel", "fill_combine_metadata_kernel",
    "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel", "topk_scores_grad_kernel",
)  # fmt: skip


class TorchtitanVersionError(ScriptMistakeError):
    """The installed torchtitan is not one this project was tested with: no restart helps."""

    exit_code = contract.EXIT_BAD_CONFIG


def check_version() -> str:
    """The installed torchtitan's version, if it is one of ``TESTED``; else the error says
    which were tested and how to install one."""
    try:
        version = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        raise TorchtitanVersionError(
            "torchtitan is not installed: pip install 'diloco-anywhere[torchtitan]' "
            f"(torchtitan=={TESTED[-1]})"
        ) from None
    if version not in TESTED:
        raise TorchtitanVersionError(
            f"torchtitan {version} is installed; diloco-anywhere runs torchtitan "
            f"{', '.join(TESTED)} (the versions its trainer and CPU changes were tested with): "
            f"pip install torchtitan=={TESTED[-1]}"
        )
    return version


class _CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` with the calls torchtitan makes of a device module (memory statistics,
    device properties, seeds), answered as a CPU has them."""

    def __init__(self) -> None:
        super().__init__("diloco_anywhere_torchtitan_cpu")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def set_device(self, device: Any) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def is_available(self) -> bool:
        return True

    def synchronize(self, device: Any = None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return {}

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        pass

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def get_device_properties(self, device: Any = None) -> Any:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(name="cpu", total_memory=memory)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)


@functools.cache
def prepare_cpu() -> None:
    """Apply changes 1-4 (see the module's docstring), before anything of torchtitan is
    imported; once. Nothing where CUDA is present."""
    if torch.cuda.is_available():
        return
    _device_is_cpu()
    _stand_in_for_triton_kernels()
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = distributed_c10d._set_pg_timeout  # type: ignore[attr-defined]
    _force_sum_reductions()


def _device_is_cpu() -> None:
    device_type, device_module = (
        torch._utils._get_available_device_type,
        torch._utils._get_device_module,
    )
    cpu_module = _CpuDeviceModule()

    def available_device_type() -> str:
        return device_type() or "cpu"

    def module_of(kind: str | None = None) -> Any:
        return cpu_module if (kind or available_device_type()) == "cpu" else device_module(kind)

    torch._utils._get_available_device_type = available_device_type
    torch._utils._get_device_module = module_of


def _stand_in_for_triton_kernels() -> None:
    if importlib.util.find_spec("triton") is not None:
        return
    kernels = types.ModuleType(KERNELS)

    def unavailable(*_: Any, **__: Any) -> None:
        raise RuntimeError("Triton is not installed: MinimalAsyncEP (CUDA only) cannot run")

    for name in KERNEL_FUNCTIONS:
        setattr(kernels, name, unavailable)
    sys.modules[KERNELS] = kernels


def _force_sum_reductions() -> None:
    import torchtitan.distributed.fsdp as fsdp

    disable_division = fsdp.disable_fsdp_gradient_division

    def disable_division_with_sums(model: torch.nn.Module) -> None:
        disable_division(model)
        for module in model.modules():
            if isinstance(module, fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = disable_division_with_sums


def cpu_attention(config: Any) -> Any:
    """``config`` (a ``Trainer.Config``) with each FlexAttention of its model computed as
    masked SDPA on the CPU (change 5); as it is where CUDA is present."""
    if torch.cuda.is_available():
        return config
    from torchtitan.models.common.attention import FlexAttention

    class CpuFlexAttention(FlexAttention):
        """FlexAttention's module (its block masks are still built), computing its forward
        with SDPA and the block mask made dense: the CPU has FlexAttention's forward only."""

        @dataclass(kw_only=True, slots=True)
        class Config(FlexAttention.Config):
            pass

        def forward(  # type: ignore[override]  # FlexAttention's names: its local_map reads them
            self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,  # noqa: N803
            attention_masks: Any, score_mod: Any = None, scale: float | None = None,
            enable_gqa: bool = False, out_transform: Any = None, **_: Any,
        ) -> torch.Tensor:  # fmt: skip
            if score_mod is not None or out_transform is not None:
                raise NotImplementedError("score_mod and out_transform on the CPU")
            from torch.nn.attention.flex_attention import create_mask

            q, k, v = (tensor.transpose(1, 2) for tensor in (q_BLNH, k_BLNH, v_BLNH))
            mask = create_mask(
                attention_masks.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device
            )
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
            )
            return out.transpose(1, 2)

    for _name, _attention, parent, attribute in config.model_spec.model.traverse(
        FlexAttention.Config
    ):
        setattr(parent, attribute, CpuFlexAttention.Config())
    return config
