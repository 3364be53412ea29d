"""A WAN in front of a stand-in: a TCP proxy that shapes each replica's link to its store.

An object store reached over a WAN is slow per connection and fast in aggregate: each TCP
connection runs at tens of MB/s (its window over the round-trip time), every request pays a
round trip, and a host's link caps the sum. A loopback stand-in has none of that, so a sync
benchmarked against it says nothing about parallelism. ``ShapedLink`` adds all three, per
replica: ``latency`` seconds of round trip (half each way, every byte delayed as a long cable
does), ``bandwidth`` bytes/s per connection and direction, and ``link`` bytes/s for all of the
replica's connections together, both directions sharing it (so a round cannot beat
``(bytes up + bytes down) / link``: the bound ``diloco bench sync`` compares against).

The proxy runs an asyncio loop on a thread of the benchmarking process; replicas reach it on
127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

CHUNK = 64 * 1024


@dataclass(frozen=True)
class WanShape:
    bandwidth: float  # bytes/s per connection and direction
    latency: float  # seconds of round trip added to every request
    link: float  # bytes/s of all the replica's connections, both directions together


class _Link:
    """The replica's shared link: a chunk may start once the link has sent what was before."""

    def __init__(self, rate: float) -> None:
        self.rate, self.free_at = rate, 0.0

    def reserve(self, now: float, nbytes: int) -> float:
        """When a chunk of ``nbytes`` that is ready at ``now`` has crossed the link."""
        self.free_at = max(self.free_at, now) + nbytes / self.rate
        return self.free_at


async def _pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, shape: WanShape, link: _Link
) -> None:
    """Copy one direction: each chunk leaves ``latency / 2`` after it arrived, no sooner than
    this connection's and the link's rates allow."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=256)

    async def receive() -> None:
        while data := await reader.read(CHUNK):
            await queue.put((loop.time() + shape.latency / 2, data))
        await queue.put((loop.time() + shape.latency / 2, b""))

    receiving = asyncio.create_task(receive())
    connection_free = 0.0
    try:
        while True:
            due, data = await queue.get()
            if not data:
                break
            start = max(due, connection_free, loop.time())
            connection_free = start + len(data) / shape.bandwidth
            done = max(connection_free, link.reserve(start, len(data)))
            await asyncio.sleep(max(0.0, done - loop.time()))
            writer.write(data)
            await writer.drain()
    finally:
        receiving.cancel()
        with contextlib.suppress(Exception):
            writer.close()


class ShapedLink:
    """One replica's shaped link to ``target`` (host, port), listening on a free local port."""

    def __init__(self, target: tuple[str, int], shape: WanShape) -> None:
        self.target, self.shape = target, shape
        self._link = _Link(shape.link)
        self.port = 0

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Pump both directions until either side closes. Cancelled at shutdown, it ends
        quietly: Python 3.11's ``start_server`` reads the handler task's ``exception()``,
        which raises (and prints a traceback) for a task that ends cancelled."""
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
            await asyncio.gather(
                _pump(reader, upstream_writer, self.shape, self._link),
                _pump(upstream_reader, writer, self.shape, self._link),
                return_exceptions=True,
            )
        except (OSError, asyncio.CancelledError):
            writer.close()

    async def start(self) -> asyncio.Server:
        server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        return server


async def _shut_down(servers: list[asyncio.Server]) -> None:
    """Stop listening, and end every connection's pumps before the loop stops."""
    for server in servers:
        server.close()
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@contextlib.contextmanager
def shaped_links(
    target: tuple[str, int], shape: WanShape, count: int
) -> Iterator[list[ShapedLink]]:
    """``count`` links (one per replica) to ``target``, served until the block ends."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="wan", daemon=True)
    thread.start()
    links = [ShapedLink(target, shape) for _ in range(count)]
    servers = [asyncio.run_coroutine_threadsafe(link.start(), loop).result() for link in links]
    try:
        yield links
    finally:
        asyncio.run_coroutine_threadsafe(_shut_down(servers), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
