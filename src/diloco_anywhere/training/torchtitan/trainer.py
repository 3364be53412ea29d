"""torchtitan's own ``Trainer`` as a replica of the run: ``DilocoTrainer``.

torchtitan's fault tolerance (``experiments/torchft``) builds a ``torchft.Manager`` that talks
to a Lighthouse every replica must reach; here replicas reach nothing but the bucket. So the
core ``Trainer`` (its model, parallelisms, optimizer, schedule, data and logging, all built by
torchtitan from the job's config) trains under ``replica.diloco`` instead: torchft's own
``DiLoCo`` over this project's ``BucketManager``, hooked on the optimizer's ``step`` as every
other task is (docs/api.md), with the run's outer optimizer, pace, checkpoints and heals. The
subclass changes four things of the loop and nothing else:

- where it starts and stops: at the run's inner step after the heal on entry, until the
  run's outer steps are committed (``training.done``), not ``training.steps``;
- the learning-rate schedule follows the run's step (a heal moves it; ``run_step`` under
  ``pace = "time"``), through the container's own ``load_state_dict`` of ``last_epoch``;
- the loss torchtitan logs is also the run's (``diloco status``, ``report``);
- with ``[task] data`` in run.toml, its loader is the run's (``run_data.py``): the run's one
  order of the prepared corpus, claimed in the bucket as for every task; otherwise the job's
  own data loader reads its own dataset from its start, and the data plan is the job's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torchtitan.trainer import Trainer

from diloco_anywhere.data.tokenizers import HfTokenizer
from diloco_anywhere.training.replica import Replica
from diloco_anywhere.training.torchtitan.run_data import (
    Batch,
    JobTokenizer,
    RunDataLoader,
    run_batches,
)
from diloco_anywhere.training.training import Training


class DilocoTrainer(Trainer):
    """torchtitan's ``Trainer``, trained as ``replica``'s inner loop by ``train_replica``."""

    training: Training | None = None

    def train_replica(self, replica: Replica) -> None:
        """Train the job's model under ``replica.diloco`` until the run's outer steps are
        committed; the replica's ``with`` records how it ended."""
        [model] = self.model_parts  # one part: pipeline parallelism is refused (job.py)
        seq_len, sequences = self._step_shape()
        tokens = seq_len * sequences  # one optimizer step's, which weighs its contributions
        with replica.diloco(model, self.optimizers, tokens_per_step=tokens) as training:
            self.training = training
            if replica.config.task.data:
                self._read_the_run_s_data(replica, seq_len, sequences)
            self._follow_the_run()
            self.metrics_processor.log = logged_to_the_run(self.metrics_processor.log, training)
            super().train()

    def _step_shape(self) -> tuple[int, int]:
        """(sequence length, sequences in one optimizer step of this process)."""
        training = self.config.training
        return training.seq_len, training.local_batch_size * self.gradient_accumulation_steps

    def _read_the_run_s_data(self, replica: Replica, seq_len: int, sequences: int) -> None:
        """run.toml's ``[task] data`` into the run's loader (``job.py`` put it in place of the
        job's), read with the job's own tokenizer."""
        assert self.training is not None
        assert isinstance(self.dataloader, RunDataLoader)
        tokenizer = HfTokenizer(self.config.hf_assets_path, JobTokenizer(self.tokenizer))
        stream = replica.stream(seq_len, sequences, tokenizer=tokenizer)
        sequences_a_pass = self.config.training.local_batch_size
        self.dataloader.read(run_batches(self.training, stream, sequences_a_pass))

    def _follow_the_run(self) -> None:
        """The loop's step and the schedule at the run's inner step."""
        assert self.training is not None
        self.step = self.training.run_step
        if self.lr_schedulers.schedulers[0].last_epoch != self.step:
            self.lr_schedulers.load_state_dict({"last_epoch": self.step})

    def train_step(self, data_iterator: Iterator[Batch]) -> None:
        """torchtitan's step (its forward, backward, clipping and the optimizer's step, in
        which DiLoCo syncs every ``sync_every / fragments`` steps), then the loop follows the
        run (a sync that healed this replica moved it)."""
        super().train_step(data_iterator)
        self._follow_the_run()

    def should_continue_training(self) -> bool:
        """Until the run's outer steps are committed: a replica paced by time trains more or
        fewer than ``training.steps`` steps."""
        return self.training is not None and not self.training.done


def logged_to_the_run(log_step: Callable[..., None], training: Training) -> Callable[..., None]:
    """torchtitan's ``MetricsProcessor.log``, also giving the loss it logs (the mean over the
    step's tokens, every ``metrics.log_freq`` steps), its learning rate and gradient norm to
    the run's metrics (``training.log``)."""

    def log_both(
        step: int, loss: float, max_loss: float, grad_norm: float,
        extra_metrics: dict[str, Any] | None = None, **rest: Any,
    ) -> None:  # fmt: skip
        log_step(step, loss, max_loss, grad_norm, extra_metrics=extra_metrics, **rest)
        rates = [value for name, value in (extra_metrics or {}).items() if name.startswith("lr")]
        values = {"grad_norm": grad_norm, **({"lr": rates[0]} if rates else {})}
        training.log(loss, **values)

    return log_both
