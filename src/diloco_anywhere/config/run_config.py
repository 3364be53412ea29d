"""``RunConfig``: a whole run.toml, its sections together, and what a run derives from them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from diloco_anywhere.bucket.agreement import Electorate
from diloco_anywhere.bucket.redaction import redact_url
from diloco_anywhere.collective.policy import CollectiveConfig
from diloco_anywhere.config.diloco import DilocoSection
from diloco_anywhere.config.sections import (
    AlertsSection,
    BudgetSection,
    CheckpointSection,
    ImageSection,
    KeepSection,
    RunSection,
    SyncSection,
    TaskSection,
    _Section,
)


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
