"""run.toml's tables other than ``[diloco]``: each a validated section with its defaults."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ByteSize, ConfigDict, Field, model_validator

from diloco_anywhere.bucket.format.layout import NAME
from diloco_anywhere.bucket.schemes import check_store_url
from diloco_anywhere.collective.policy import (
    FLOAT32_BYTES,
    CollectiveConfig,
    ExchangeChoice,
    LeasePolicy,
    RoundPolicy,
)

PositiveInt = Annotated[int, Field(ge=1)]
Seconds = Annotated[float, Field(gt=0)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunSection(_Section):
    name: Annotated[str, Field(pattern=rf"^{NAME.pattern}$")] = "demo"
    # A path, file://, s3://, gs://, az://; a relative path is relative to run.toml's folder.
    store: Annotated[str, AfterValidator(check_store_url)] = ".diloco/demo/store"
    replicas: PositiveInt = 4
    min_replicas: PositiveInt = 1
    seed: int = 0
    # How a replica of several processes (processes_per_replica > 1) holds the model: "ddp",
    # a whole copy per process and rank 0 alone syncing; "fsdp", FSDP2 shards, every rank
    # syncing its own (docs/backends.md, "Sharded replicas").
    sharding: Literal["ddp", "fsdp"] = "ddp"

    @model_validator(mode="after")
    def _quorum_fits(self) -> RunSection:
        if self.min_replicas > self.replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) must be at most replicas ({self.replicas})"
            )
        return self


class SyncSection(_Section):
    """How rounds seal, exchange and give up, and how often leases are renewed: the defaults
    are the collective's own (``collective/policy.py``, which documents each), and the
    section builds the policies the collective runs with."""

    mode: ExchangeChoice = RoundPolicy.mode
    grace: Seconds = RoundPolicy.grace  # wait this long for stragglers once min_replicas are in
    timeout: Seconds = RoundPolicy.timeout
    lease_period: Seconds = LeasePolicy.period
    keep_rounds: PositiveInt = CollectiveConfig.keep_rounds
    # Parts in flight per round, and the float32 bytes of each: a sync's host memory
    # (window x part_size) and its concurrent requests (docs/collective.md, "Memory").
    window: Annotated[int, Field(ge=1, le=256)] = RoundPolicy.window
    # The widest it may grow to where a wider window moves parts faster (docs/run-toml.md)
    window_max: Annotated[int, Field(ge=1, le=256)] = RoundPolicy.window_max
    part_size: Annotated[ByteSize, Field(ge=64 << 10, le=1 << 30)] = ByteSize(
        RoundPolicy.part_elements * FLOAT32_BYTES
    )

    def round_policy(self, run: RunSection) -> RoundPolicy:
        return RoundPolicy(
            min_replicas=run.min_replicas, expected_replicas=run.replicas, grace=self.grace,
            timeout=self.timeout, mode=self.mode, window=self.window,
            window_max=self.window_max,  # below window: fixed there (AdaptiveWindow)
            part_elements=self.part_size // FLOAT32_BYTES,
        )  # fmt: skip

    def lease_policy(self) -> LeasePolicy:
        return LeasePolicy(period=self.lease_period)


class CheckpointSection(_Section):
    """Global checkpoints in the bucket (docs/checkpoints.md): what healing and resume start
    from. Rounds after the oldest kept checkpoint stay in the bucket for replay."""

    every: PositiveInt = 10  # committed syncs between checkpoints (also after the first and last)
    # Committed checkpoints kept; older ones are deleted. At least 2: when the newest does not
    # read back intact, healing falls back to the one before.
    keep: Annotated[int, Field(ge=2)] = 2
    # Other stores every committed checkpoint is copied to (mirrors.py): losing the run's
    # store then loses no checkpoint.
    mirrors: Annotated[
        list[Annotated[str, AfterValidator(check_store_url)]], Field(max_length=4)
    ] = Field(default_factory=list)
    # Each single-process replica also saves its own state (inner optimizer, random generators,
    # buffers) under its id at every checkpoint step, so that a restart goes on exactly where
    # it stopped (training/recovery/own_state.py); about 2 to 3 times the model's bytes per replica.
    own_state: bool = True


# false, true (torch.compile's default backend, Inductor) or one of torch's own backends
Compile = Literal[False, True, "inductor", "cudagraphs", "aot_eager", "eager"]


class TaskSection(_Section):
    entrypoint: Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")] = (
        "diloco_anywhere.tasks.gpt:build"
    )
    device: str = "auto"  # auto: cuda when there is one, else cpu
    # torch.compile the module the built-in loop's inner steps run through (a script of one's
    # own compiles its model itself): the first steps compile (a minute or so), later ones run
    # faster on a GPU. Checkpoints and exports hold the model's own names either way. true is
    # torch.compile's own default backend, Inductor; a name picks another of torch's built-in
    # backends (torch.compiler docs: "cudagraphs" replays CUDA graphs without Inductor's
    # kernels; "aot_eager" traces forward and backward but runs them eagerly, the first step
    # when bisecting a compile failure, and compiles nothing with a C++ or Triton compiler).
    compile: Compile = False
    options: dict[str, Any] = Field(default_factory=dict)
    log_every: PositiveInt = 10  # inner steps between two loss lines in the metrics
    # Outer steps between held-out evaluations (and always the last one); 0: never.
    eval_every: Annotated[int, Field(ge=0)] = 1
    # Your own training script as the replica, e.g. ["python", "train.py"]: run instead of the
    # built-in loop, in run.toml's folder (elsewhere: the image's working directory); it joins
    # the run with diloco_anywhere.join() (docs/api.md). "python" is the replica's interpreter.
    command: Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=256)] = Field(
        default_factory=list
    )
    # Seconds the command has to call diloco_anywhere.join() before the replica fails.
    join_timeout: Annotated[float, Field(gt=0)] = 600.0
    # A warm start: a safetensors file of the model's whole state_dict (a path relative to
    # run.toml's folder, or a store URL: e.g. the model.safetensors `diloco export` writes)
    # that the built-in loop loads into every replica's model before training.
    init_from: str = ""
    # The training data: a corpus prepared once by `diloco data prepare` (a store URL, or a
    # path relative to run.toml's folder). Replicas stream it by ranged reads and claim their
    # parts of the run's one order of it in the bucket (docs/data.md); the built-in tasks
    # read it in place of their `corpus` / `data` option.
    data: str = ""


class ImageSection(_Section):
    """The one image every remote platform starts (images/Dockerfile); local replicas run from
    this checkout instead."""

    ref: str = ""  # e.g. ghcr.io/<owner>/<project>:latest; a digest pins it exactly


class KeepSection(_Section):
    """What ``diloco keep`` may do to keep an unattended run going (docs/backends.md,
    "Unattended runs"). Backoff follows Kubernetes' crash-loop backoff: the wait before a
    restart doubles with each attempt in a row that ended within ``stable_after``."""

    max_restarts: Annotated[int, Field(ge=0)] = 10  # per replica, over the whole run
    backoff: Seconds = 60.0  # wait before restarting a replica whose attempt ended quickly
    max_backoff: Seconds = 1800.0
    stable_after: Seconds = 600.0  # an attempt that ran this long resets the backoff
    # A job its platform says runs, whose replica's lease has not advanced this long (or
    # that never claimed): hung; stopped and started again.
    hung_after: Seconds = 1800.0
    # Attempts of a replica in a row that end before it contributes to a round (a time limit
    # shorter than its start and heal, a crash at start): past this, not restarted, alerted.
    # Counted whatever ended them, its platform's time limit included.
    max_fruitless: Annotated[int, Field(ge=1)] = 3


class BudgetSection(_Section):
    """A run's spending cap, and what its estimates assume (``launching/cost/cost_estimate.py``).
    Prices are public list prices with their date (``launching/cost/prices.py``); override them for
    your discounts."""

    max_hours: Annotated[float, Field(ge=0)] = 0.0  # wall hours since the launch; 0: no cap
    max_usd: Annotated[float, Field(ge=0)] = 0.0  # estimated spend; 0: no cap
    # Seconds per inner step, for the plan and the estimate before the run has measured it;
    # 0: measured, else assumed. (No field of run.toml is None: TOML has no null, and a
    # config dumped to TOML must load back.)
    step_seconds: Annotated[float, Field(ge=0)] = 0.0
    # A platform's own seconds per inner step where its hardware differs from step_seconds'
    # (e.g. {sagemaker = 0.8} for A10Gs beside H100s): the estimate prices its rounds' waiting.
    platform_step_seconds: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)
    # USD per replica-hour, "platform" or "platform/hardware" -> price, over the table's.
    hourly_usd: dict[str, Annotated[float, Field(ge=0)]] = Field(default_factory=dict)
    # USD per GB leaving a cloud ("aws", "gcp", "azure", "hf", "modal", ...), over the table's.
    egress_usd_per_gb: dict[str, Annotated[float, Field(ge=0)]] = Field(default_factory=dict)
    # The model's parameter count, for the traffic estimate of a task that is not built before
    # training (any but the built-in GPT task, whose model is counted without its weights).
    parameters: Annotated[int, Field(ge=0)] = 0  # 0: counted where the task allows
    # Where a platform's replicas run, or the store ("store"), when its default is wrong for
    # egress: e.g. {k8s = "gcp"}; default sagemaker aws, modal modal, hf_jobs hf, k8s unknown.
    clouds: dict[str, Literal["aws", "gcp", "azure", "hf", "modal", "local", "unknown"]] = Field(
        default_factory=dict
    )


class AlertsSection(_Section):
    """Where the run's events go (``launching/keep/alerts.py``): a Slack- or Discord-compatible
    webhook whose URL is in an environment variable (a URL is a secret: never in run.toml)."""

    webhook_env: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] = "DILOCO_ALERT_WEBHOOK"
    stalled_after: Seconds = 1800.0  # alert when no round has sealed for this long
