"""``make gpu-check`` (``diloco bench gpu``) on the CPU at tiny sizes: every check of
../shared/GPU-CHECKS.md runs here on every commit, so the first minute of a lent GPU is never
spent on a typo; and the runner's own rules: a check's processes end with it, a check that
outlives its limit fails saying so, targets are judged on a GPU only."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from diloco_anywhere.bench.gpu.outcome import Judge
from diloco_anywhere.bench.gpu.plan import CHECK_NAMES, SIZES, Check
from diloco_anywhere.bench.gpu.runner import run_one, running
from diloco_anywhere.bench.tools.plain_loop import (
    StepTime,
    inner_intervals,
    inner_tokens_per_second,
)
from support.runs import diloco

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


@pytest.mark.integration
@pytest.mark.timeout(1800)
def test_every_gpu_check_passes_on_the_cpu_through_make_gpu_checks_script(tmp_path):
    """The script a lent GPU runs (.ci/gpu-check), with --device cpu: one line per check,
    each PASS, and gpu-check.json with every check's numbers beside each check's log."""
    ended = subprocess.run(
        [str(ROOT / ".ci" / "gpu-check"), "--device", "cpu", "--out", str(tmp_path),
         "--budget", "1800"],
        cwd=ROOT, capture_output=True, text=True, timeout=1750, check=False,
    )  # fmt: skip
    assert ended.returncode == 0, ended.stdout + ended.stderr
    summary = json.loads((tmp_path / "gpu-check.json").read_text())
    expected = {name: "PASS" for name in CHECK_NAMES}  # the CPU's compile needs no compiler
    assert {row["name"]: row["status"] for row in summary["checks"]} == expected, ended.stdout
    assert all((tmp_path / f"gpu-check-{name}.log").exists() for name in CHECK_NAMES)
    lines = [line for line in ended.stdout.splitlines() if line[:4] in ("PASS", "FAIL", "SKIP")]
    assert [line.split()[1] for line in lines] == list(CHECK_NAMES)
    assert ended.stdout.startswith("on CPU, Python ")
    assert "every requirement met" in ended.stdout

    numbers = {row["name"]: row["numbers"] for row in summary["checks"]}
    losses = numbers["replica"]["eval_losses"]
    assert len(losses) == SIZES["cpu"].outer_steps
    assert losses[-1] < losses[0]
    assert numbers["replica"]["plain_tokens_per_second"] > 0
    assert numbers["codecs"]["codecs"]["int8"]["bytes_equal_to_host"]
    assert numbers["codecs"]["feedback_residual_exact"]
    assert numbers["sync"]["host_memory_added_bytes"] > 0
    assert numbers["fsdp"]["apart_vs_moved"] == 0  # the CPU's one run, against itself
    assert "exact" in numbers["compile"]["resumed"][0]
    assert "compiled (aot_eager)" in ended.stdout


def test_inner_throughput_counts_the_intervals_free_of_syncs_between_two_syncs():
    """Syncs (and what follows them: evaluation, checkpoints) happen inside every H-th step:
    an interval holding one, or outside the span asked for, is left out; plain loops are
    measured over the same intervals."""
    times = [(0, 0.0), (2, 1.0), (4, 9.0), (6, 10.0), (8, 19.0), (10, 20.0), (12, 29.0)]
    lines = [StepTime(step, time, step * 10) for step, time in times]
    # H = 4: (4, 6] and (8, 10] are free of syncs, 1 s each; (6, 8] and (10, 12] hold one
    assert [a.step for a, _ in inner_intervals(lines, 4)] == [4, 8]
    assert inner_tokens_per_second(inner_intervals(lines, 4)) == (40 / 2, 4)
    assert [a.step for a, _ in inner_intervals(lines, 4, first=2)] == [8]
    assert [a.step for a, _ in inner_intervals(lines, 4, first=1, last=2)] == [4]
    with pytest.raises(ValueError, match="no logged interval free of syncs"):
        inner_tokens_per_second(inner_intervals(lines[:3], 4))


@pytest.mark.parametrize(("device", "status"), [("cuda", "FAIL"), ("cpu", "PASS")])
def test_targets_are_judged_on_a_gpu_only_and_requirements_everywhere(device, status):
    judge = Judge(torch.device(device))
    judge.target(False, "fast enough: 0.5")
    outcome = judge.outcome("numbers", {})
    assert outcome.status == status
    assert (outcome.failures, outcome.notes) == (
        (["fast enough: 0.5"], []) if device == "cuda" else ([], ["fast enough: 0.5"])
    )
    judge.require(False, "agrees")
    assert judge.outcome("numbers", {}).status == "FAIL"


def _tests_importable(monkeypatch) -> None:
    """The check processes import their targets from tests/support."""
    paths = [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))


@pytest.mark.integration
def test_a_check_ends_with_every_process_it_started_even_in_sessions_of_their_own(
    tmp_path, monkeypatch
):
    _tests_importable(monkeypatch)
    check = Check("child", "a detached child", "support.gpu_checks:leaves_a_detached_child", 60)
    ran = run_one(check, "cpu", tmp_path / "work", 300, tmp_path)
    assert ran.outcome.status == "PASS", ran.outcome.reason
    child = int((tmp_path / "work" / "files" / "child.pid").read_text())
    assert not running(child)


@pytest.mark.integration
def test_a_check_past_its_limit_fails_saying_so_with_its_log(tmp_path, monkeypatch):
    _tests_importable(monkeypatch)
    check = Check("slow", "never ends", "support.gpu_checks:never_ends", 60)
    ran = run_one(check, "cpu", tmp_path / "work", 2, tmp_path)
    assert ran.outcome.status == "FAIL"
    assert ran.outcome.reason.startswith("timed out after 2 s; its log ends:")
    assert (tmp_path / "gpu-check-slow.log").exists()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--only", "replica,warp"], "warp: the checks are replica, codecs, sync, fsdp, compile"),
        (["--device", "tpu"], "'tpu': cuda or cpu"),
    ],
)
def test_bench_gpu_refuses_unknown_checks_and_devices(arguments, message):
    result = diloco("bench", "gpu", *arguments)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


@pytest.mark.integration
def test_bench_gpu_on_cuda_without_a_gpu_skips_every_check_saying_why(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the checks would run")
    result = diloco("bench", "gpu", "--out", str(tmp_path), "--only", "codecs")
    assert result.exit_code == 0, result.output
    assert "SKIP codecs" in result.output
    assert "no CUDA device here (torch.cuda.is_available() is False)" in result.output
