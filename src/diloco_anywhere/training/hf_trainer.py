"""A Hugging Face ``transformers.Trainer`` as a replica: ``DilocoCallback`` (docs/api.md,
"Hugging Face ``Trainer`` as a replica").

    with diloco_anywhere.join() as replica:
        trainer = Trainer(model, args, train_dataset=shard,
                          callbacks=[DilocoCallback(replica)])
        trainer.train()

The Trainer's loop, optimizer, scheduler, data and logging stay its own; the callback trains
them under ``replica.diloco``, which hooks the optimizer's ``step``: the Trainer steps it once
every ``gradient_accumulation_steps`` micro-batches (``Trainer._run_epoch``), so an inner step
of DiLoCo is an optimizer step of the Trainer. What the run decides is set through the
Trainer's callback events (``transformers.TrainerCallback``), in the order ``Trainer`` calls
them: ``max_steps`` at ``on_init_end`` (read by ``set_initial_training_values`` when
``train()`` starts: the scheduler spans the run), the run's state and schedule position at
``on_train_begin`` (the first event with the optimizer and scheduler built:
``_prepare_for_training`` builds them just before), the end at ``on_step_end`` and
``on_train_end``. Needs ``transformers`` and ``accelerate`` (the Trainer's own requirement):
``pip install 'diloco-anywhere[hf-task]'``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn
from torch.utils.data import IterableDataset
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import SaveStrategy

from diloco_anywhere.data.stream import Stream
from diloco_anywhere.training.mistakes.output_claims import claim_output_dir
from diloco_anywhere.training.replica import Replica
from diloco_anywhere.training.training import Training

log = logging.getLogger(__name__)

# torch's warning when a scheduler steps before its optimizer ever has: moving the schedule
# to where the run is, before the Trainer's first step, is meant.
EARLY_SCHEDULER_STEP = r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`"
# Logged values recorded with the loss: what Trainer._maybe_log_save_evaluate logs with it.
LOGGED_WITH_LOSS = ("learning_rate", "grad_norm")


class DilocoCallback(TrainerCallback):
    """Makes the ``Trainer`` it is given to a DiLoCo replica of ``replica``'s run.

    ``tokens_per_step``: what one optimizer step of the Trainer trains on in this process,
    which weighs the replica's contributions; by default the Trainer's own arguments say it
    (``per_device_train_batch_size x gradient_accumulation_steps``, times the sequence length
    when the Trainer reads the run's data, ``dataset``). ``evaluate(model)``: a held-out loss,
    as for ``replica.diloco``.

    The run decides ``args.max_steps`` (``replica.total_steps``) and where the learning-rate
    schedule is: a replica that restarts or heals resumes the Trainer's schedule at the run's
    inner step. The Trainer's ``state.global_step`` stays its own count of this process's
    optimizer steps (moving it would skew the loss the Trainer averages over the steps since
    its last log), and so does its data order: a restarted replica's Trainer starts its
    dataset over from its first batch, as ``trainer.train()`` without
    ``resume_from_checkpoint`` does, while its model, outer optimizer and schedule resume where
    the run is. The Trainer stops once the run's outer steps are committed.

    A Trainer that saves checkpoints claims its ``output_dir`` for this replica as it is
    built: another replica of the run given the same folder (every local replica runs in
    run.toml's folder) is stopped then, saying how to give each its own
    (``output_dir=f"out/{replica.replica_id}"``)."""

    def __init__(
        self,
        replica: Replica,
        *,
        tokens_per_step: int | None = None,
        evaluate: Callable[[nn.Module], float] | None = None,
    ) -> None:
        self.replica, self.tokens_per_step, self.evaluate = replica, tokens_per_step, evaluate
        self.training: Training | None = None
        self._sequence_tokens = 1  # tokens a sample trains on, where the run's data says
        self._diloco = ExitStack()

    def dataset(self, stream: Stream) -> RunDataset:
        """The run's data for the Trainer's ``train_dataset``: ``stream``
        (``replica.stream(seq_len, batch_sequences)``, ``batch_sequences`` being one optimizer
        step's: ``per_device_train_batch_size x gradient_accumulation_steps``), resumed
        with the replica (``RunDataset``)."""
        self._sequence_tokens = stream.shape.seq_len
        return RunDataset(self, stream)

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        """The run decides how many optimizer steps the Trainer takes, and so what its
        scheduler spans (``Trainer.create_scheduler(num_training_steps=max_steps)``). The
        Trainer's ``output_dir`` is claimed for this replica, before anything trains."""
        self._claim_output_dir(args)
        total = self.replica.total_steps
        if args.max_steps not in (-1, total):  # -1: TrainingArguments' "not set"
            log.warning(
                "max_steps = %d replaced by the run's %d inner steps (outer_steps x "
                "sync_every in run.toml): the run decides how long each replica trains",
                args.max_steps, total,
            )  # fmt: skip
        args.max_steps = total

    def _claim_output_dir(self, args: TrainingArguments) -> None:
        """A Trainer that saves checkpoints (``save_strategy`` other than ``"no"``) saves them
        in ``output_dir``, which must be this replica's alone: another replica of the run
        that claimed it first stops this one (``SharedOutputDirError``, exit 2), while the
        Trainer is built (``output_claims.py``). Its process that saves claims it
        (``args.should_save``). A folder that cannot be claimed (read-only, say) is the
        Trainer's to fail on as it saves, not this check's."""
        if args.save_strategy == SaveStrategy.NO or not args.should_save:
            return
        run, me = self.replica.config.run.name, self.replica.replica_id
        try:
            claim_output_dir(args.output_dir, run, me)
        except OSError as exc:
            log.warning(
                "output_dir %s could not be claimed for replica %s (%s): another replica "
                "given it too would not be found", args.output_dir, me, exc,
            )  # fmt: skip

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        **_: Any,
    ) -> None:
        """Train under ``replica.diloco`` (it heals the model to the run's state first) with
        the Trainer's own optimizer, unwrapped from accelerate's ``AcceleratedOptimizer``:
        DiLoCo hooks the torch optimizer's ``step``, which the wrapper's ``step`` calls. The
        context stays open until ``on_train_end``, or until the replica's ``with`` ends on an
        error inside ``trainer.train()`` (``Replica.contexts``)."""
        self._check_max_steps(state.max_steps)
        if isinstance(optimizer, AcceleratedOptimizer):
            optimizer = optimizer.optimizer
        self.replica.contexts.enter_context(self._diloco)
        tokens = self._tokens_per_step(args)
        self.training = self._diloco.enter_context(
            self.replica.diloco(model, optimizer, tokens_per_step=tokens, evaluate=self.evaluate)
        )
        self._schedule_to_run(lr_scheduler)
        self._add_configs_to_export(model)

    def _tokens_per_step(self, args: TrainingArguments) -> int:
        """The script's ``tokens_per_step``, else one optimizer step's samples as the Trainer's
        arguments give them, in tokens when it reads the run's data: the same on every
        replica running the script, so their contributions weigh alike."""
        if self.tokens_per_step is not None:
            return self.tokens_per_step
        samples = args.per_device_train_batch_size * args.gradient_accumulation_steps
        return samples * self._sequence_tokens

    def _add_configs_to_export(self, model: nn.Module) -> None:
        """The model's configuration files as ``save_pretrained`` writes them, for ``diloco
        export`` to write beside the weights: ``from_pretrained`` reads ``config.json`` (and
        a generating model's ``generation_config.json``) before any weight."""
        for name, attribute in (("config.json", "config"),
                                ("generation_config.json", "generation_config")):  # fmt: skip
            config = getattr(model, attribute, None)
            if config is not None and hasattr(config, "to_json_string"):
                self.replica.add_to_export(name, config.to_json_string())

    def _check_max_steps(self, planned: int) -> None:
        """The Trainer plans the run's steps, unless the callback came after ``on_init_end``
        (``trainer.add_callback``): its scheduler would then span another length."""
        if planned != self.replica.total_steps:
            raise ValueError(
                f"the Trainer plans {planned} optimizer steps and the run "
                f"{self.replica.total_steps}: give DilocoCallback to Trainer(callbacks=[...]), "
                f"which has the run set max_steps as the Trainer is built, not to "
                f"trainer.add_callback afterwards"
            )

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        *,
        lr_scheduler: Any,
        **_: Any,
    ) -> None:
        """Stop once the run's outer steps are committed, not before: a replica paced above
        ``sync_every`` steps a round (``pace = "time"``) goes on past ``max_steps``, which
        sets what the schedule spans; after a heal that moved this replica on, its schedule
        follows."""
        self._schedule_to_run(lr_scheduler)
        if self.training.done:  # type: ignore[union-attr]
            control.should_training_stop = True
        elif state.global_step >= state.max_steps:  # the Trainer's own end: not the run's
            control.should_training_stop = False

    def _schedule_to_run(self, lr_scheduler: Any) -> None:
        """Step the Trainer's scheduler up to the run's inner step. Every schedule the Trainer
        steps once per optimizer step (``lr_scheduler_type`` but ``reduce_lr_on_plateau`` and
        ``greedy``, which follow the eval metric) counts its steps in ``last_epoch``."""
        schedulers = torch.optim.lr_scheduler
        if not isinstance(lr_scheduler, schedulers.LRScheduler) or isinstance(
            lr_scheduler, schedulers.ReduceLROnPlateau
        ):
            return
        behind = self.training.run_step - lr_scheduler.last_epoch  # type: ignore[union-attr]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", EARLY_SCHEDULER_STEP, UserWarning)
            for _ in range(behind):
                lr_scheduler.step()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        *,
        logs: dict[str, float],
        **_: Any,
    ) -> None:
        """The Trainer's training loss (its mean over ``logging_steps``) into the run's metrics,
        with the learning rate and gradient norm logged with it. Its other logs (evaluation,
        the summary at the end) carry no ``loss``."""
        if "loss" in logs:
            values = {name: logs[name] for name in LOGGED_WITH_LOSS if name in logs}
            self.training.log(logs["loss"], **values)  # type: ignore[union-attr]

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        """Leave ``replica.diloco``: the run's last checkpoint is written, and every process
        checks it holds the global state."""
        self._diloco.close()


class RunDataset(IterableDataset):
    """The run's data as a ``Trainer`` reads it: examples ``{"input_ids", "labels"}`` of
    ``seq_len + 1`` tokens (the model shifts the labels itself), an optimizer step's
    sequences at a time, from the inner step the run is at. Opened when ``trainer.train()``
    begins (the callback has healed the replica by then) and opened again where the run is
    after a heal, so a restarted or healed replica trains what the run's claims say, never
    its dataset again from the start. For one process's ``DataLoader`` (the Trainer's own,
    ``dataloader_num_workers = 0``)."""

    def __init__(self, callback: DilocoCallback, stream: Stream) -> None:
        super().__init__()
        self.callback, self.stream = callback, stream

    def __len__(self) -> int:
        """The most examples one replica trains over the run, if it never restarts (the
        Trainer wants a length, or ``max_steps`` before the callback sets it; it ends at the
        run's end, ``on_step_end``)."""
        most = self.callback.replica.config.diloco.most_total_steps
        return most * self.stream.shape.batch_sequences

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        training = self.callback.training
        if training is None:
            raise RuntimeError(
                "the run's dataset is read once trainer.train() has begun: give it to the "
                "Trainer with DilocoCallback in Trainer(callbacks=[...])"
            )
        while not training.done:
            heals = training.heals
            batches = self.stream.batches(training.start_step)
            # asked before each step's sequences are: after a heal the data goes on where the
            # run is. (accelerate's loader reads a batch ahead, so the round after the run's
            # last is claimed anyway: in flight at the end, given back if the run goes on.)
            while training.heals == heals and not training.done:
                yield from ({"input_ids": row, "labels": row} for row in next(batches))
            batches.close()
