"""``[diloco]`` and ``[diloco.sparse]``: the algorithm's settings, its pace and its codec, and a
benchmark's ``--codec`` spelled as run.toml spells one."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from diloco_anywhere.bucket.codecs.codec_names import CODEC_NAMES, DEFAULT_CODEC, CodecName
from diloco_anywhere.config.errors import ConfigError, problems
from diloco_anywhere.config.sections import PositiveInt, _Section


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
