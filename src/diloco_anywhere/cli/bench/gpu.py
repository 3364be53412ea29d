"""``diloco bench gpu``: the paths only a GPU takes, checked in one command (``make
gpu-check`` on a lent GPU; ``--device cpu`` at tiny sizes inside ``make test``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from diloco_anywhere.cli.bench.options import JsonOutput
from diloco_anywhere.cli.common import print_json, stderr, stdout

if TYPE_CHECKING:
    from diloco_anywhere.bench.gpu.plan import Check
    from diloco_anywhere.bench.gpu.runner import Ran

STYLES = {"PASS": "green", "FAIL": "red", "SKIP": "yellow"}


def _out_folder() -> Path:
    """The device tool's ``$OUT`` when set (what is written there comes back), else here."""
    return Path(os.environ.get("OUT") or ".diloco/gpu-check")


def _names(text: str | None) -> list[str]:
    from diloco_anywhere.bench.gpu.plan import CHECK_NAMES

    if text is None:
        return list(CHECK_NAMES)
    names = [name.strip() for name in text.split(",")]
    if unknown := [name for name in names if name not in CHECK_NAMES]:
        raise typer.BadParameter(
            f"{', '.join(unknown)}: the checks are {', '.join(CHECK_NAMES)}", param_hint="--only"
        )
    return names


def _line(ran: Ran) -> str:
    """``PASS replica 63 s  <numbers>``, then what failed, why it could not run or was
    skipped, and the targets not judged on the CPU, indented."""
    outcome = ran.outcome
    reason = outcome.reason.splitlines()
    head = outcome.summary or (reason[0] if reason else "")
    details = [*outcome.failures, *(reason if outcome.summary else reason[1:])]
    details += [f"(not judged on the CPU) {note}" for note in outcome.notes]
    style = STYLES[outcome.status]
    lines = [f"[{style}]{outcome.status}[/] {ran.name:<8} {ran.seconds:5.0f} s  {head}"]
    return "\n".join(lines + [f"      {detail}" for detail in details])


def bench_gpu_command(
    device: Annotated[
        str, typer.Option(help="cuda (a lent GPU), or cpu: the same checks at tiny sizes.")
    ] = "cuda",
    only: Annotated[
        str | None,
        typer.Option(
            help="Checks to run, comma-separated (default: all, in order): "
            "replica, codecs, sync, fsdp, compile."
        ),
    ] = None,
    budget: Annotated[
        float,
        typer.Option(
            min=30,
            help="Seconds for all the checks together: a check that would "
            "start with less than 30 s left is skipped (rerun it with --only).",
        ),
    ] = 480.0,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Folder for gpu-check.json and each check's log (default: $OUT "
            "when set, else .diloco/gpu-check)."
        ),
    ] = None,
    json_output: JsonOutput = False,
) -> None:
    """Check the paths only a GPU takes, in one command (../shared/GPU-CHECKS.md).

    In order, each in a fresh process under its own time limit: two real replicas of a
    ~100M-parameter Llama (int8, bf16 autocast) with their inner-step throughput against a
    plain loop; int8 and sparse on 1 GiB of device tensors; the host memory of a 4 GiB sync
    from device tensors; FSDP2 over NCCL against the same run on the CPU; torch.compile of
    the built-in loop, resumed and exported. One line per check: PASS, FAIL (what was
    missed) or SKIP (why), with its numbers; gpu-check.json holds them all. Exits 1 if a
    check failed. Targets (speed, memory) are judged on a GPU only.
    """
    if device not in ("cuda", "cpu"):
        raise typer.BadParameter(f"{device!r}: cuda or cpu", param_hint="--device")
    names, folder = _names(only), out or _out_folder()
    from diloco_anywhere.bench.gpu.environment import describe, line
    from diloco_anywhere.bench.gpu.runner import run_checks

    console = stderr if json_output else stdout

    def starting(check: Check, limit: float) -> None:
        console.print(
            f"...  {check.name:<8} {check.title} (limit {limit:.0f} s)",
            highlight=False, soft_wrap=True,
        )  # fmt: skip

    def report(ran: Ran) -> None:
        console.print(_line(ran), highlight=False, soft_wrap=True)

    import torch

    environment = describe(torch.device(device))
    console.print(f"on {line(environment)}", highlight=False, soft_wrap=True)
    summary = run_checks(device, names, budget, folder, environment, report, starting)
    _finish(summary, folder, console, json_output)


def _finish(summary: dict[str, Any], folder: Path, console: Any, json_output: bool) -> None:
    statuses = [row["status"] for row in summary["checks"]]
    counts = {status: statuses.count(status) for status in STYLES}
    console.print(
        f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped in "
        f"{summary['seconds']:.0f} s; written to {folder / 'gpu-check.json'}",
        highlight=False,
    )
    if json_output:
        print_json(summary)
    if counts["FAIL"]:
        raise typer.Exit(1)
