"""What several ``diloco bench`` commands share: the store they measure (--store or
--standin), the WAN in front of it (--bandwidth, --latency, --link), --json, and lists of
numbers."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from typing import TYPE_CHECKING, Annotated, Any

import typer

from diloco_anywhere.cli.common import parse_size
from diloco_anywhere.standins import STANDINS, standin

if TYPE_CHECKING:
    from diloco_anywhere.bench.tools.wan import WanShape


STORE_OPTION = typer.Option(
    "--store",
    help="Store URL to measure: a path, file://, s3://, gs://, az://, hf://buckets/... "
    "(credentials from the environment). Default: a temporary local folder.",
)
STANDIN_OPTION = typer.Option(
    "--standin", help=f"Start a local stand-in server and measure it: {', '.join(STANDINS)}."
)
JsonOutput = Annotated[
    bool, typer.Option("--json", help="Print one JSON object instead of the tables.")
]


Bandwidth = Annotated[
    int | None,
    typer.Option(
        parser=parse_size,
        help="WAN: bytes/s per connection (e.g. 25MB), through a shaped link per replica "
        "(bench sharded: per rank) in front of --standin s3.",
    ),
]
Latency = Annotated[
    float, typer.Option(min=0, help="WAN: seconds of round trip added to every request.")
]
Link = Annotated[
    int | None,
    typer.Option(
        parser=parse_size,
        help="WAN: bytes/s of each replica's (bench sharded: each rank's) link, both "
        "directions together (default: 8 connections' worth).",
    ),
]


def bench_target(
    stack: ExitStack, url: str | None, standin_name: str | None, status: Callable[[str], None]
) -> tuple[str, dict[str, Any]]:
    """The store URL and storage options to measure: given, a stand-in, or a temp folder."""
    if url and standin_name:
        raise typer.BadParameter("give --store or --standin, not both")
    if standin_name:
        status(f"starting the {standin_name} stand-in")
        server = stack.enter_context(standin(standin_name))
        return f"{server.url}/bench", server.storage_options
    return url or stack.enter_context(tempfile.TemporaryDirectory(prefix="diloco-bench-")), {}


def wan_shape(bandwidth: int | None, latency: float, link: int | None) -> WanShape | None:
    """--bandwidth, --latency and --link as a shape; None (no WAN) without --bandwidth."""
    from diloco_anywhere.bench.tools.wan import WanShape

    if bandwidth is None:
        return None
    return WanShape(bandwidth=bandwidth, latency=latency, link=link or 8 * bandwidth)


def wan_options(
    stack: ExitStack, options: dict[str, Any], shape: WanShape | None, processes: int
) -> list[dict[str, Any]]:
    """Per process (a replica, or a rank), its storage options: with a shape, the stand-in's
    through a shaped link of its own; without, ``options`` as they are."""
    from urllib.parse import urlsplit

    from diloco_anywhere.bench.tools.wan import shaped_links

    if shape is None:
        return [options] * processes
    endpoint = urlsplit(options.get("endpoint_url", ""))
    if not endpoint.port:
        raise typer.BadParameter("--bandwidth shapes a stand-in's link: give --standin s3")
    target = (endpoint.hostname, endpoint.port)
    links = stack.enter_context(shaped_links(target, shape, processes))
    return [{**options, "endpoint_url": f"http://127.0.0.1:{link.port}"} for link in links]


def number_list(text: str, kind: type, low: float, high: float, what: str) -> list[Any]:
    """``1,2,4`` -> [1, 2, 4]: comma-separated numbers of ``kind``, each ``low`` to ``high``
    (``what`` says what they are, with an example, when they are not)."""
    try:
        numbers = [kind(part) for part in str(text).split(",")]
    except ValueError:
        numbers = []
    if not numbers or not all(low <= n <= high for n in numbers):
        raise typer.BadParameter(f"{text!r}: give {what}")
    return numbers
