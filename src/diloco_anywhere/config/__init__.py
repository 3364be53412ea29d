"""run.toml: one file describes a run. Validated on load; a bad file starts nothing.

Every field has a default except where a run cannot guess (none today: the embedded default,
``default_run.toml``, is a complete run of the built-in task on local processes). Errors list
every bad field on its own line: its path, the value found, and what is allowed.

DiLoCo defaults follow the paper (arXiv 2311.08105, section 3): inner AdamW, outer SGD with
Nesterov momentum 0.9 and learning rate 0.7. ``diloco bench convergence`` confirmed 0.7 for 4
replicas and found 0.5 best for one (docs/tuning.md).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from diloco_anywhere.bucket.agreement import Electorate
from diloco_anywhere.bucket.codecs.codec_names import CODEC_NAMES, DEFAULT_CODEC, CodecName
from diloco_anywhere.bucket.format.layout import NAME
from diloco_anywhere.bucket.redaction import redact_url
from diloco_anywhere.bucket.schemes import check_store_url
from diloco_anywhere.collective.policy import (
    CollectiveConfig,
    ExchangeChoice,
    LeasePolicy,
    RoundPolicy,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PositiveInt = Annotated[int, Field(ge=1)]
Seconds = Annotated[float, Field(gt=0)]
DEFAULT_CONFIG = "default_run.toml"
FLOAT32_BYTES = 4  # a part holds float32 values: part_size bytes are part_size / 4 elements


class ConfigError(ValueError):
    """A run.toml that cannot start a run; the message has one line per problem."""


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


class SparseSection(_Section):
    """``[diloco.sparse]``: what ``codec = "sparse"`` sends (``bucket/codecs/sparse_codec.py``) and
    the error feedback that keeps what it leaves out (``bucket/feedback.py``), SparseLoCo's
    method (arXiv 2508.15706). The defaults are what ``diloco bench convergence`` measured
    best at 1/50 of fp32's bytes (docs/tuning.md, "Sparse"): 8% of every chunk of 4,096 at 2
    bits, the accumulator decayed by 0.95 per sync, as SparseLoCo does. SparseLoCo's own 1.56%
    sends 1/186 and lost to it at every H tried here."""

    density: Annotated[float, Field(gt=0, le=1)] = 0.08  # kept per chunk: k = density x chunk
    bits: Annotated[int, Field(ge=1, le=4)] = 2  # per kept value: a sign and 2^(bits-1) levels
    chunk: Annotated[int, Field(ge=64, le=65536, multiple_of=64)] = 4096  # values per top-k
    error_decay: Annotated[float, Field(gt=0, le=1)] = 0.95  # the accumulator's, per sync

    @property
    def k(self) -> int:
        """Values kept per chunk."""
        return max(1, round(self.density * self.chunk))


# SparseLoCo's outer step (arXiv 2508.15706, Algorithm 1): the mean of the sparse updates
# applied as it is, scaled by the outer learning rate, error feedback standing in for outer
# momentum. What a run with codec = "sparse" gets for the outer fields it does not set; 2.0
# measured best for 4 replicas (docs/tuning.md, "Sparse").
SPARSE_OUTER = {"outer_lr": 2.0, "outer_momentum": 0.0, "outer_nesterov": False}


# A replica paced by time within this share of the round's pace trains sync_every / fragments:
# two replicas of one GPU type measure steps a few percent apart, round to round
PACE_TOLERANCE = 0.1


class DilocoSection(_Section):
    sync_every: PositiveInt = 50  # H: inner steps between two syncs of the same fragment set
    outer_steps: PositiveInt = 10  # the run ends after this many committed outer steps
    fragments: PositiveInt = 1  # > 1: Streaming DiLoCo (arXiv 2501.18512)
    fragment_sync_delay: Annotated[int, Field(ge=0)] = 0  # tau, in inner steps
    codec: CodecName = DEFAULT_CODEC
    sparse: SparseSection = Field(default_factory=SparseSection)  # with codec = "sparse"
    inner_lr: Annotated[float, Field(gt=0)] = 1e-3
    inner_weight_decay: Annotated[float, Field(ge=0)] = 0.1
    outer_lr: Annotated[float, Field(gt=0)] = 0.7
    outer_momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    outer_nesterov: bool = True
    # How many inner steps each replica trains a round (docs/tuning.md, "Mixed hardware"):
    # "steps": sync_every / fragments each, the round closing at the slowest one's pace;
    # "time": as many as fit in the round's length, each contribution weighted by its tokens.
    pace: Literal["steps", "time"] = "steps"
    # with pace = "time" (0: the default; TOML has no null)
    round_seconds: Annotated[float, Field(ge=0)] = 0.0  # 0: H / fragments of the fastest's steps
    min_round_steps: Annotated[int, Field(ge=0)] = 0  # 0: about an eighth of H / fragments
    max_round_steps: Annotated[int, Field(ge=0)] = 0  # 0: 4 x H / fragments

    @model_validator(mode="before")
    @classmethod
    def _sparse_outer_step(cls, data: Any) -> Any:
        """With ``codec = "sparse"``, the outer fields not given are SparseLoCo's."""
        if isinstance(data, dict) and data.get("codec") == "sparse":
            return {**SPARSE_OUTER, **data}
        return data

    def codec_params(self) -> dict[str, int]:
        """The wire codec's parameters beyond its name (``bucket.codec.make_codec``)."""
        if self.codec != "sparse":
            return {}
        return {"chunk": self.sparse.chunk, "k": self.sparse.k, "bits": self.sparse.bits}

    @property
    def total_steps(self) -> int:
        """The inner steps each replica trains over the whole run: what a learning-rate
        schedule spans, and what the platforms' time limits are planned against."""
        return self.outer_steps * self.sync_every

    @property
    def most_total_steps(self) -> int:
        """The most inner steps a replica can train over the run: ``total_steps``, unless
        rounds are paced by time (then every round at ``max_round_steps``)."""
        return self.last_step * self.round_steps_bounds[1]

    @property
    def round_steps(self) -> int:
        """The inner steps of a round (one fragment's sync) at the reference pace: every
        replica's with ``pace = "steps"``, the fastest one's with ``"time"``."""
        return self.sync_every // self.fragments

    @property
    def step_quantum(self) -> int:
        """What a replica's steps in a round are a multiple of: the steps of one unit of the
        run's data (``data/claims.py``). A round's, without pacing by time."""
        if self.pace == "steps":
            return self.round_steps
        if self.min_round_steps:
            return self.min_round_steps
        eighth = max(1, self.round_steps // 8)
        return max(d for d in range(1, eighth + 1) if self.round_steps % d == 0)

    @property
    def round_steps_bounds(self) -> tuple[int, int]:
        """The fewest and the most inner steps a replica trains in a round."""
        if self.pace == "steps":
            return self.round_steps, self.round_steps
        most = self.max_round_steps or 4 * self.round_steps
        return self.step_quantum, most

    def steps_to_fit(self, seconds: float, step_seconds: float) -> int:
        """The steps a replica paced by time trains in a round of ``seconds`` at
        ``step_seconds`` a step (``training/pacing/pace.py``; the estimate,
        ``launching/cost/round_plan``), within ``round_steps_bounds``: ``round_steps`` for a replica
        within ``PACE_TOLERANCE`` of the round's pace (the fastest's, measured with noise), else the
        whole ``step_quantum`` units that fit, rounded down. A round closes when its last
        contribution comes, so a replica that trains a unit more than fits keeps every other
        replica waiting, and one that trains less idles only itself."""
        quantum, (least, most) = self.step_quantum, self.round_steps_bounds
        fitting = seconds / step_seconds
        if self.round_steps / (1 + PACE_TOLERANCE) <= fitting <= self.round_steps:
            return min(max(self.round_steps, least), most)
        steps = int(fitting / quantum + 1e-9) * quantum
        return min(max(steps, least), most)

    @property
    def last_step(self) -> int:
        """The manager's step once the run is done: every fragment has synced ``outer_steps``
        times (the step a Streaming DiLoCo manager counts per fragment's sync)."""
        return self.outer_steps * self.fragments

    @model_validator(mode="after")
    def _streaming_schedule(self) -> DilocoSection:
        """torchft's DiLoCo syncs one fragment every sync_every / fragments steps and needs
        each fragment's sync done before its next one starts."""
        if self.sync_every % self.fragments:
            raise ValueError(
                f"sync_every ({self.sync_every}) must be a multiple of fragments ({self.fragments})"
            )
        if self.fragment_sync_delay >= self.sync_every // self.fragments:
            raise ValueError(
                f"fragment_sync_delay ({self.fragment_sync_delay}) must be less than "
                f"sync_every / fragments ({self.sync_every // self.fragments})"
            )
        return self

    @model_validator(mode="after")
    def _pace(self) -> DilocoSection:
        """The bounds of a round's steps hold whole units of data and make room for
        ``fragment_sync_delay``; they mean nothing without pacing by time."""
        timed = {"round_seconds": self.round_seconds, "min_round_steps": self.min_round_steps,
                 "max_round_steps": self.max_round_steps}  # fmt: skip
        given = [name for name, value in timed.items() if value]
        if self.pace == "steps" and given:
            verb = "applies" if len(given) == 1 else "apply"
            raise ValueError(f'{", ".join(given)} {verb} only with pace = "time"')
        if self.pace == "steps":
            return self
        least, most = self.round_steps_bounds
        if self.round_steps % least:
            raise ValueError(
                f"min_round_steps ({least}) must divide sync_every / fragments "
                f"({self.round_steps}): the data is claimed in units of min_round_steps steps"
            )
        if most < self.round_steps or most % least:
            raise ValueError(
                f"max_round_steps ({most}) must be a multiple of min_round_steps ({least}), "
                f"at least sync_every / fragments ({self.round_steps})"
            )
        if self.fragment_sync_delay >= least:
            raise ValueError(
                f"fragment_sync_delay ({self.fragment_sync_delay}) must be less than "
                f"min_round_steps ({least}): a fragment is sent that many steps before its sync"
            )
        return self

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> DilocoSection:
        """torch's SGD refuses Nesterov without momentum; say so before any replica starts."""
        if self.outer_nesterov and self.outer_momentum == 0:
            raise ValueError(
                "outer_nesterov = true needs outer_momentum > 0 (e.g. 0.9); for plain SGD "
                "outer steps set outer_nesterov = false"
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
    part_size: Annotated[ByteSize, Field(ge=64 << 10, le=1 << 30)] = ByteSize(
        RoundPolicy.part_elements * FLOAT32_BYTES
    )

    def round_policy(self, run: RunSection) -> RoundPolicy:
        return RoundPolicy(
            min_replicas=run.min_replicas, expected_replicas=run.replicas, grace=self.grace,
            timeout=self.timeout, mode=self.mode, window=self.window,
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


class TaskSection(_Section):
    entrypoint: Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")] = (
        "diloco_anywhere.tasks.gpt:build"
    )
    device: str = "auto"  # auto: cuda when there is one, else cpu
    # torch.compile the module the built-in loop's inner steps run through (a script of one's
    # own compiles its model itself): the first steps compile (a minute or so), later ones run
    # faster on a GPU. Checkpoints and exports hold the model's own names either way.
    compile: bool = False
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


def parse_codec(spec: str) -> tuple[CodecName, SparseSection]:
    """A benchmark's ``--codec``: a codec name, and for ``sparse`` any of its run.toml
    settings after colons (``sparse:density=0.03:bits=4``); ``ConfigError`` naming what is
    allowed."""
    name, *settings = spec.split(":")
    if name not in CODEC_NAMES:
        raise ConfigError(f"codec {spec!r}: the name is one of {', '.join(CODEC_NAMES)}")
    pairs = [setting.partition("=") for setting in settings]
    allowed = sorted(SparseSection.model_fields) if name == "sparse" else []
    if any(key not in allowed or not sep for key, sep, _ in pairs):
        raise ConfigError(
            f"codec {spec!r}: settings are key=value after colons, keys "
            f"{', '.join(allowed) or f'(none for {name})'}"
        )
    try:
        return name, SparseSection.model_validate({key: value for key, _, value in pairs})  # type: ignore[return-value]
    except ValidationError as exc:
        raise ConfigError(problems(exc, f"codec {spec!r}", "sparse")) from None


def describe_codec(name: str, sparse: SparseSection) -> str:
    """``int8``, or ``sparse 1.56% 2-bit``: how tables name a codec."""
    return f"sparse {sparse.k / sparse.chunk:.2%} {sparse.bits}-bit" if name == "sparse" else name


class RunConfig(_Section):
    run: RunSection = Field(default_factory=RunSection)
    diloco: DilocoSection = Field(default_factory=DilocoSection)
    sync: SyncSection = Field(default_factory=SyncSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    task: TaskSection = Field(default_factory=TaskSection)
    image: ImageSection = Field(default_factory=ImageSection)
    keep: KeepSection = Field(default_factory=KeepSection)
    budget: BudgetSection = Field(default_factory=BudgetSection)
    alerts: AlertsSection = Field(default_factory=AlertsSection)
    # Per-backend settings ([backends.modal] ...), validated by each backend when it launches.
    backends: dict[str, dict[str, Any]] = Field(default_factory=dict)
    source: Path | None = Field(default=None, exclude=True)  # where it was loaded from

    @model_validator(mode="after")
    def _mirrors_are_other_stores(self) -> RunConfig:
        """A mirror that is the store, or one listed twice, would have two writers copying
        into the same folders (a copy replaces what is there that is not its checkpoint)."""
        seen = {self.run.store: "run.store"}
        for index, url in enumerate(self.checkpoint.mirrors):
            if url in seen:
                raise ValueError(
                    f"checkpoint.mirrors.{index} = {redact_url(url)!r} is also {seen[url]}: "
                    f"each mirror must be a store of its own"
                )
            seen[url] = f"checkpoint.mirrors.{index}"
        return self

    def collective_config(self) -> CollectiveConfig:
        """What a replica's collective runs with: ``[sync]``'s policies and the codec, built
        here once (in torch: only a replica calls this)."""
        from diloco_anywhere.bucket.codecs.codec import make_codec

        return CollectiveConfig(
            codec=make_codec(self.diloco.codec, **self.diloco.codec_params()),
            round=self.sync.round_policy(self.run),
            lease=self.sync.lease_policy(), keep_rounds=self.sync.keep_rounds,
        )  # fmt: skip

    def electorate(
        self,
        index: int,
        replica: str,
        since: float | None = None,
        check: Callable[[], None] | None = None,
    ) -> Electorate:
        """Who votes on the records every replica must start with, and how long they wait
        (``bucket/agreement.py``): as the run's first round waits for its replicas. ``since``:
        when the replica began voting (``time.monotonic``), by default now; ``check``: raises
        while it waits when the run cannot go on."""
        electorate = Electorate(index, replica, self.run.replicas, self.run.min_replicas,
                                self.sync.grace, self.sync.timeout,
                                check_every=self.sync.lease_period)  # fmt: skip
        if since is not None:
            electorate = replace(electorate, since=since)
        return electorate if check is None else replace(electorate, check=check)

    def training_settings(self) -> dict[str, Any]:
        """What every replica of a run must train with, by dotted name: the DiLoCo section,
        the replica counts and the sharding (``contract.check_same_training``)."""
        run = {f"run.{name}": getattr(self.run, name)
               for name in ("name", "replicas", "min_replicas", "sharding")}  # fmt: skip
        diloco = {f"diloco.{name}": value for name, value in self.diloco.model_dump().items()}
        return {**run, **diloco}

    def store_url(self) -> str:
        """The store URL, with a relative local path made absolute against run.toml's folder."""
        return self.resolve(self.run.store)

    def mirror_urls(self) -> list[str]:
        """``[checkpoint] mirrors``, relative local paths made absolute as ``store_url``."""
        return [self.resolve(url) for url in self.checkpoint.mirrors]

    def resolve(self, url: str) -> str:
        """``url``, a local path relative to run.toml's folder made absolute (as ``run.store``
        and ``[checkpoint] mirrors`` are read)."""
        if "://" in url or Path(url).is_absolute():
            return url
        base = self.source.parent if self.source else Path.cwd()
        return str((base / url).resolve())


def problems(exc: ValidationError, where: str, prefix: str = "") -> str:
    """One line per bad field: where, its dotted path (under ``prefix``), the value, the rule."""
    lines = []
    for error in exc.errors(include_url=False):
        path = ".".join([prefix] * bool(prefix) + [str(part) for part in error["loc"]])
        shown = error["type"] != "missing" and not isinstance(error["input"], dict)
        found = f" = {error['input']!r:.60}" if shown else ""
        message = error["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {path or '(top level)'}{found}: {message}")
    return "\n".join(lines)


def validate_config(data: dict[str, Any], where: str, source: Path | None = None) -> RunConfig:
    try:
        return RunConfig.model_validate({**data, "source": source})
    except ValidationError as exc:
        raise ConfigError(problems(exc, where)) from None


def with_changes(config: RunConfig, **changes: Any) -> RunConfig:
    """``config`` with ``section__field=value`` changes (``keep__max_restarts=3``), validated
    as a file is, from the same file (relative paths still read from its folder)."""
    data = config.model_dump()
    for path, value in changes.items():
        section, _, name = path.partition("__")
        data[section][name] = value
    where = f"{config.source or 'the embedded run'} with {', '.join(changes)}"
    return validate_config(data, where, config.source)


def parse_config(text: str, where: str, source: Path | None = None) -> RunConfig:
    """Every way ``text`` can fail to be a run config is one ``ConfigError`` line: the CLI
    prints it and exits 2, never a traceback (a TOML nested thousands of levels deep exhausts
    the parser's recursion)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{where}: not valid TOML: nested too deeply") from None
    try:
        return validate_config(data, where, source)
    except RecursionError:
        raise ConfigError(f"{where}: a value is nested too deeply") from None


def load_config(path: str | Path | None = None) -> RunConfig:
    """run.toml at ``path``, or the embedded default (local processes, a local store)."""
    if path is None:
        text = resources.files("diloco_anywhere").joinpath(DEFAULT_CONFIG).read_text()
        return parse_config(text, f"(embedded {DEFAULT_CONFIG})")
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); TOML is UTF-8") from None
    return parse_config(text, str(path), source=path.resolve())
