"""A replica's own state: saved at the run's checkpoint steps, put back when the replica
restarts, so that it goes on as if it had not stopped.

Healing (``healing.py``) brings back the run's global state: the global weights, the outer
momentum and the counters every replica holds alike. DiLoCo leaves the rest to each replica
(arXiv 2311.08105, algorithm 1): its inner optimizer (AdamW's moments and step counts) and,
with Streaming DiLoCo (arXiv 2501.18512, fragments > 1), the local weights of the fragments
not synced at that point; and its training draws from its own random generators (dropout,
sampling). No other replica holds them, so no peer could send them, as torchft's healing
sends what its peers hold: a restarted replica used to start them afresh, its AdamW
re-warming (about 0.1 to 0.2% of loss after a restart).

So at every global checkpoint step (``after_sync.checkpoint_due``) every single-process
replica writes its own state to local files on the training thread, right after the sync, a
shard at a time from the state itself (it changes at the next inner step: at disk speed, and
with host memory bounded by a shard, not by AdamW's 2x the model), and uploads it under its id
on a thread of its own (``checkpoints/replica_states.py``). A replica
joining the run (``Training.heal`` from its initial state, not after a divergence: then its
own state is current) loads, once its global state is healed to round R, the newest saved
state of its id of a round at most R (a later one is from a run started over) that reads back
intact and fits its model and optimizer. Saved at round R itself, the restart is exact: the
run ends with the same bits as without it. Older, only the inner optimizer, the generators
and the buffers are loaded: its local weights are behind the global ones healed since.

Best effort both ways: a save that fails is lost (logged) and training goes on; a state that
does not read back or does not fit is passed over (logged), the replica then starting its own
state fresh, as before. Replicas of several processes (``torchrun``: DDP or FSDP) neither save
nor load one (docs/checkpoints.md).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_map

from diloco_anywhere.bucket.feedback import ErrorFeedback
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import RunConfig
from diloco_anywhere.training.checkpoints.objects import Spools
from diloco_anywhere.training.checkpoints.records import CheckpointError
from diloco_anywhere.training.checkpoints.replica_states import (
    StagedState,
    read_replica_state,
    saved_rounds,
    stage_replica_state,
    write_replica_state,
)
from diloco_anywhere.training.checkpoints.staging import HostStaging
from diloco_anywhere.training.managers.bucket import BucketManager
from diloco_anywhere.training.recovery.after_sync import checkpoint_due
from diloco_anywhere.training.state.global_state import (
    check_optimizer_state,
    check_weights,
    fill_from,
    is_tensor_like,
)

log = logging.getLogger(__name__)

WORDS = 2**32  # a Mersenne Twister's state words are 32-bit
PYTHON_WORDS, NUMPY_WORDS = 625, 624  # ``random.getstate``'s (with its index), NumPy's keys


def local_tensors(model: nn.Module, with_weights: bool) -> dict[str, torch.Tensor]:
    """The model's replica-local tensors, by ``state_dict`` name (sharing their storage): its
    persistent buffers (a norm's running statistics, which DiLoCo never syncs) and, with
    ``with_weights`` (fragments > 1), its parameters."""
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return {
        name: tensor
        for name, tensor in model.state_dict().items()
        if with_weights or name not in parameters
    }


def random_states() -> dict[str, Any]:
    """Python's, NumPy's (global) and torch's generators (the CPU's, and each GPU's once CUDA
    is in use), as tree leaves: word arrays as int64 tensors, the rest as JSON values."""
    version, words, gauss = random.getstate()
    name, keys, position, has_gauss, cached = np.random.get_state()
    return {
        "python": {"version": version, "words": torch.tensor(words), "gauss": gauss},
        "numpy": {
            "name": name, "keys": torch.from_numpy(keys.astype(np.int64)),
            "position": int(position), "has_gauss": int(has_gauss), "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
    }  # fmt: skip


def own_tree(
    model: nn.Module,
    inner: torch.optim.Optimizer,
    with_weights: bool,
    feedback: ErrorFeedback | None = None,
) -> dict:
    """What a replica saves of its own (references to its tensors, not copies): with a sparse
    codec, its error feedback's accumulators too, by fragment."""
    return {
        "optimizer": {"class": type(inner).__qualname__, "state": inner.state_dict()},
        "random": random_states(),
        "local": local_tensors(model, with_weights),
        "feedback": feedback.state_dict() if feedback is not None else {},
    }


def _feedback_buffers(
    key: str, saved: Any, fragments: list[nn.Module], device: torch.device
) -> dict[str, torch.Tensor]:
    """Saved error-feedback accumulators, checked: one flat float32 tensor per fragment it
    names, of that fragment's size, on ``device``."""
    if not isinstance(saved, dict):
        raise ValueError(f"{key}: the error feedback is not a table of accumulators")
    sizes = {str(i): sum(p.numel() for p in f.parameters()) for i, f in enumerate(fragments)}
    for stream, buffer in saved.items():
        if stream not in sizes or not (
            is_tensor_like(buffer)
            and buffer.dtype == torch.float32
            and buffer.shape == (sizes[stream],)
        ):
            raise ValueError(
                f"{key}: error feedback {stream!r} is not a float32 accumulator of a fragment "
                f"(this model's: {sizes})"
            )
    return {stream: on_device(buffer, device) for stream, buffer in saved.items()}


def _words(key: str, what: str, value: Any, count: int) -> list[int]:
    """A generator's state words, checked: ``count`` int64 values from 0 to 2^32 - 1."""
    if not (
        isinstance(value, torch.Tensor)
        and value.dtype == torch.int64
        and value.shape == (count,)
        and bool(((value >= 0) & (value < WORDS)).all())
    ):
        raise ValueError(f"{key}: {what} must be {count} words from 0 to {WORDS - 1}")
    return value.tolist()


def _field(key: str, node: Any, name: str, kinds: type | tuple[type, ...]) -> Any:
    if not (isinstance(node, dict) and isinstance(node.get(name), kinds)):
        raise ValueError(f"{key}: the state holds no {name} of the right kind")
    return node[name]


class _Generators:
    """Saved generator states, each checked on a scratch generator of its kind (which raises
    on a state it cannot take) before any global one is set."""

    def __init__(self, key: str, saved: Any) -> None:
        python = _field(key, saved, "python", dict)
        numpy = _field(key, saved, "numpy", dict)
        self.python = (
            _field(key, python, "version", int),
            tuple(_words(key, "Python's generator", python.get("words"), PYTHON_WORDS)),
            _field(key, python, "gauss", (float, type(None))),
        )
        self.numpy = (
            _field(key, numpy, "name", str),
            np.array(_words(key, "NumPy's generator", numpy.get("keys"), NUMPY_WORDS), np.uint32),
            _field(key, numpy, "position", int),
            _field(key, numpy, "has_gauss", int),
            _field(key, numpy, "cached", float),
        )
        self.torch = _field(key, saved, "torch", torch.Tensor)
        self.cuda = _field(key, saved, "cuda", list)
        try:
            random.Random().setstate(self.python)
            np.random.RandomState().set_state(self.numpy)
            torch.Generator().set_state(self.torch)
        except Exception as exc:  # each kind says what it refuses in its own words
            raise ValueError(f"{key}: a generator state does not load: {exc}") from None

    def set(self) -> None:
        """Set the global generators; CUDA's only on as many GPUs as were saved from."""
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch)
        if self.cuda and len(self.cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(self.cuda)
        elif self.cuda:
            log.warning("own state: saved from %d GPUs, this process has %d: their generators "
                        "start afresh", len(self.cuda), torch.cuda.device_count())  # fmt: skip


def load_own_state(
    key: str,
    tree: Any,
    model: nn.Module,
    inner: torch.optim.Optimizer,
    *,
    with_weights: bool,
    exact: bool,
    feedback: ErrorFeedback | None = None,
    fragments: list[nn.Module] | None = None,
    confirm: Callable[[], None] = lambda: None,
) -> None:
    """Load a saved own state (``key``: its record, named in errors) into ``model``, ``inner``
    and the global generators, every part checked to fit first (``ValueError`` naming what
    differs; or what ``confirm`` raises once the optimizer's tensors are read, a
    ``CheckpointError`` for files unlike their COMMIT; and nothing loaded): the same
    optimizer class, its groups' hyperparameter names, each parameter's state of its shape,
    the same local tensors (``local_tensors``). The local weights only when ``exact`` (saved
    at the round healed to); the buffers always. The error feedback's accumulators (of
    ``fragments``) only when ``exact`` too: one saved earlier holds what later syncs have
    sent since, and would send it twice."""
    tree = {**tree, "random": _loaded(tree.get("random"))}  # a few KiB: read before checks
    optimizer = _field(key, tree, "optimizer", dict)
    saved_class, state = _field(key, optimizer, "class", str), optimizer.get("state")
    if saved_class != type(inner).__qualname__:
        raise ValueError(f"{key}: saved from a {saved_class} inner optimizer; this replica's is "
                         f"a {type(inner).__qualname__}")  # fmt: skip
    names = {id(p): name for name, p in model.named_parameters()}
    ordered = [names.get(id(p), "?") for group in inner.param_groups for p in group["params"]]
    check_optimizer_state(key, state, inner, "inner optimizer", ordered)
    pairs = zip(state["param_groups"], inner.param_groups, strict=True)
    for index, (saved, group) in enumerate(pairs):
        if set(saved) != set(group):
            raise ValueError(f"{key}: the inner optimizer's group {index} holds {sorted(saved)}; "
                             f"this optimizer's {sorted(group)}")  # fmt: skip
    generators = _Generators(key, tree.get("random"))
    local = _field(key, tree, "local", dict)
    expected = local_tensors(model, with_weights)
    check_weights(key, local, expected, of="model's local tensors")
    buffers = None
    if exact and feedback is not None:
        device = next(model.parameters()).device
        buffers = _feedback_buffers(key, tree.get("feedback", {}), fragments or [model], device)
    optimizer_state = _on_parameters(state, inner)
    confirm()
    inner.load_state_dict(optimizer_state)
    if buffers is not None:
        feedback.load_state_dict(buffers)  # type: ignore[union-attr]
    generators.set()
    weights = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    with torch.no_grad():
        for name, tensor in expected.items():
            if exact or name not in weights:
                fill_from(tensor, local[name])


def _loaded(tree: Any) -> Any:
    """``tree`` with its checkpoint tensors read (a small part of a saved state)."""

    def read(leaf: Any) -> Any:
        return leaf if isinstance(leaf, torch.Tensor) or not is_tensor_like(leaf) else leaf.load()

    return tree_map(read, tree)


def on_device(value: Any, device: torch.device) -> Any:
    """A checkpoint tensor (or a tensor) as a tensor on ``device``: read there, a slice at a
    time, without a host copy of the whole."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return value.load(device)


def _on_parameters(state: dict[str, Any], inner: torch.optim.Optimizer) -> dict[str, Any]:
    """An inner optimizer's saved state with its checkpoint tensors read onto their
    parameters' devices (AdamW's moments, 2x the model: one tensor at a time), a step count
    onto the CPU, where torch keeps it."""
    parameters = [p for group in inner.param_groups for p in group["params"]]

    def read(index: int, value: Any) -> Any:
        if isinstance(value, torch.Tensor) or not is_tensor_like(value):
            return value
        return on_device(value, parameters[index].device if value.dim() else torch.device("cpu"))

    per_parameter = {
        index: {name: read(index, value) for name, value in values.items()}
        for index, values in state["state"].items()
    }
    return {**state, "state": per_parameter}


class OwnState:
    """This replica's own state in the bucket: saved at the run's checkpoint steps on a thread
    of its own, one save at a time, and loaded when the replica joins (``resume``)."""

    def __init__(
        self,
        config: RunConfig,
        store: Store,
        layout: RunLayout,
        replica: str,
        model: nn.Module,
        inner: torch.optim.Optimizer,
        fragments: list[nn.Module] | None = None,
    ) -> None:
        """``fragments``: the model's, as DiLoCo syncs them (the error feedback's streams)."""
        self.config, self.store, self.layout, self.replica = config, store, layout, replica
        self.model, self.inner, self.fragments = model, inner, fragments or [model]
        self.with_weights = config.diloco.fragments > 1
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="own-state")
        self._pending: Future[None] | None = None
        self._staging = HostStaging()

    @property
    def limit(self) -> int:
        """The most bytes a saved state of this model may hold: six times the model's (AdamW
        keeps two moments per weight, AMSGrad three, plus the local weights and buffers and
        the error feedback's accumulators), and 16 MiB for the generators and step counts."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return 6 * sum(t.numel() * t.element_size() for t in tensors) + (16 << 20)

    def save_if_due(self, manager: BucketManager) -> None:
        """After a committed sync at a checkpoint step: write the state to local files here
        (it changes at the next inner step), upload it on the thread. Skipped (logged) while
        the previous save still runs, except after the run's last step, which waits for it."""
        diloco, step = self.config.diloco, manager.current_step()
        last_step = diloco.last_step
        if not checkpoint_due(step, self.config.checkpoint.every, last_step):
            return
        last = step == last_step
        round_ = manager.last_round()
        if self._pending is not None and not self._pending.done() and not last:
            log.warning("own state of round %d not saved: the previous save is still being "
                        "written (raise checkpoint.every)", round_)  # fmt: skip
            return
        if self._pending is not None:
            self._pending.result()  # the run's last: after the previous one
        tree = own_tree(self.model, self.inner, self.with_weights, manager.feedback)
        try:
            staged = stage_replica_state(
                self.store, self.layout, self.replica, round_, tree, self._staging
            )
        except Exception as exc:  # best effort: a lost save costs a fresh start, not the run
            log.warning("own state of round %d not saved: %s: %s", round_,
                        type(exc).__name__, exc)  # fmt: skip
            return
        self._pending = self._executor.submit(self._write, step, staged)

    def _write(self, step: int, staged: StagedState) -> None:
        try:
            write_replica_state(self.store, self.layout, self.replica, step, staged)
        except Exception as exc:  # best effort: a lost save costs a fresh start, not the run
            log.warning("own state of round %d not saved: %s: %s", staged.round,
                        type(exc).__name__, exc)  # fmt: skip

    def resume(self, manager: BucketManager) -> str | None:
        """Once healed: load the newest saved state of a round up to the one healed to that
        reads back intact and fits, each other one passed over (logged); what was loaded, for
        the ``resumed`` event, or None (none saved, none usable: the replica's own state
        starts fresh). A store that cannot be read loses the state, not the restart."""
        healed, step = manager.state_dict()["sync"] - 1, manager.current_step()
        try:
            rounds = [r for r in saved_rounds(self.store, self.layout, self.replica) if r <= healed]
        except OSError as exc:
            log.warning("own state not restored: its saved states cannot be listed: %s", exc)
            return None
        for round_ in rounds:
            key = self.layout.replica_state_commit(self.replica, round_)
            spools = Spools()
            try:
                commit, tree = read_replica_state(
                    self.store,
                    self.layout,
                    self.replica,
                    round_,
                    self.limit,
                    spools,
                    verify=False,
                )  # its files checked as they are read, before any of it is loaded
                exact = (commit.round, commit.step) == (healed, step)
                load_own_state(key, tree, self.model, self.inner,
                               with_weights=self.with_weights, exact=exact,
                               feedback=manager.feedback, fragments=self.fragments,
                               confirm=spools.confirm)  # fmt: skip
            except (CheckpointError, ValueError, OSError) as exc:
                log.warning("own state of round %d not used: %s", round_, exc)
                continue
            finally:
                spools.release()
            if exact:
                return f"own state of round {round_} restored: exact, the round healed to"
            feedback = "; error feedback from zero" if manager.feedback is not None else ""
            return (f"own state of round {round_} restored, older than round {healed} healed "
                    f"to: inner optimizer, generators and buffers; local weights the healed "
                    f"global ones{feedback}")  # fmt: skip
        return None

    def close(self) -> None:
        """Wait for the save being written (the run's last), then stop."""
        self._executor.shutdown(wait=True)
