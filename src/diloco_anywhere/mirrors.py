"""Checkpoint mirrors: every committed checkpoint copied to other stores, so that losing the
run's store (a deleted bucket, a region outage, an expired account) does not lose the run.

The replica that commits a checkpoint copies it, after the commit, to each store of
``[checkpoint] mirrors``, under the same keys: the shards and the state first, each read back
and compared with the bytes committed, then the COMMIT, so a mirror never holds a COMMIT whose
objects are not intact there. Old checkpoints are pruned in each mirror as in the store.

A mirror never holds training back: copies run on a thread of their own, one checkpoint at a
time per mirror (a copy still running when the next checkpoint is committed is skipped for
that mirror, logged), and a mirror that fails is reported through ``report`` (the run's
metrics: ``diloco status`` shows it), never raised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from diloco_anywhere.checkpoint import prune_checkpoints
from diloco_anywhere.layout import RunLayout
from diloco_anywhere.store import Store

log = logging.getLogger(__name__)


class MirrorWriter:
    """Copies committed checkpoints to ``urls``; ``report(detail)`` hears of every failure."""

    def __init__(
        self, urls: list[str], layout: RunLayout, keep: int, report: Callable[[str], None]
    ) -> None:
        self.layout, self.keep, self.report = layout, keep, report
        self._stores = [Store(url) for url in urls]
        self._executor = ThreadPoolExecutor(max(1, len(urls)), thread_name_prefix="mirror")
        self._pending: dict[str, Future[None]] = {}

    def copy(self, round_: int, objects: dict[str, bytes], commit_key: str, commit: bytes) -> None:
        """Start copying the checkpoint of ``round_`` (``objects``: its shards and state, by
        key; then its COMMIT) to every mirror not still busy with the previous one."""
        for store in self._stores:
            pending = self._pending.get(store.url)
            if pending is not None and not pending.done():
                log.warning("mirror %s: checkpoint of round %d skipped, the previous copy is "
                            "still running", store.url, round_)  # fmt: skip
                continue
            self._pending[store.url] = self._executor.submit(
                self._copy, store, round_, objects, commit_key, commit
            )

    def _copy(
        self, store: Store, round_: int, objects: dict[str, bytes], commit_key: str, commit: bytes
    ) -> None:
        try:
            store.put_many(objects)
            for key, data in objects.items():
                if store.get(key, 0, len(data) + 1) != data:
                    raise OSError(f"{key} reads back other bytes than were written")
            store.put(commit_key, commit)
            prune_checkpoints(store, self.layout, self.keep)
            log.info("checkpoint of round %d mirrored to %s", round_, store.url)
        except Exception as exc:  # a mirror never stops training: it is reported instead
            detail = f"checkpoint of round {round_} not mirrored to {store.url}: {exc}"
            log.warning("%s", detail)
            self.report(detail)

    def close(self) -> None:
        """Wait for the copies under way (a run's last checkpoint should reach its mirrors)."""
        self._executor.shutdown(wait=True)
        for store in self._stores:
            store.close()
