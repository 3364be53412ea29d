"""The ``diloco`` CLI, invoked through typer's runner (the same parser and code as the shell)."""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from diloco_anywhere.bucket.codecs.codec import make_codec
from diloco_anywhere.cli import app, parse_size
from diloco_anywhere.cli.bench.sync import sync_table
from diloco_anywhere.collective.phases import PHASES

runner = CliRunner()
SMALL = ["--size", "256KiB", "--objects", "4", "--repeats", "1"]


def run(*args: str):
    return runner.invoke(app, list(args))


def test_help_explains_commands():
    result = run("bench", "store", "--help")
    assert result.exit_code == 0
    assert "raw file copy" in result.output
    assert "--standin" in result.output


def test_bench_store_json_has_the_documented_keys(tmp_path):
    result = run("bench", "store", "--store", f"file://{tmp_path}", "--json", *SMALL)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["store"]["size_bytes"] == 256 * 1024
    assert report["store"]["requests_per_round"]["puts"] == 4
    assert report["store"]["raw_copy"]["put_mib_s"] > 0
    codecs = report["codecs"]
    assert set(codecs) == {"fp32", "bf16", "int8", "sparse"}
    assert codecs["fp32"]["rel_l2_gaussian"] == 0
    assert codecs["int8"]["ratio"] <= 0.27
    assert codecs["int8"]["rel_l2_student_t"] <= 0.02
    assert codecs["sparse"]["ratio"] < 1 / 40  # 16,384 values: 4 chunks and the header
    assert list(tmp_path.iterdir()) == []  # the benchmark cleans up after itself


@pytest.mark.integration
def test_bench_codecs_measures_each_codec_per_gib_against_int8():
    result = run("bench", "codecs", "--size", "4MiB", "--repeats", "1", "--codec", "sparse",
                 "--codec", "sparse:density=0.015625", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    rows = {row["codec"]: row for row in report["codecs"]}
    assert list(rows) == ["int8", "sparse", "sparse:density=0.015625"]
    assert rows["int8"]["encode_plus_decode_vs_int8"] == 1.0
    assert rows["sparse"]["label"] == "sparse 8.01% 2-bit"
    assert rows["sparse:density=0.015625"]["ratio"] < rows["sparse"]["ratio"] < 1 / 50
    for row in rows.values():
        assert row["encode_seconds_per_gib"] > 0
        assert row["feedback_seconds_per_gib"] > 0
        assert 0 < row["rel_l2_gaussian"] < 1
    bad = run("bench", "codecs", "--codec", "sparse:k=64")
    assert bad.exit_code == 1
    assert "keys bits, chunk, density, error_decay" in bad.output


@pytest.mark.integration
def test_bench_store_table_against_the_s3_standin():
    result = run("bench", "store", "--standin", "s3", *SMALL)
    assert result.exit_code == 0, result.output
    assert "s3://diloco/bench" in result.stdout
    assert "raw file copy" in result.stdout
    assert "int8" in result.stdout


def test_store_and_standin_are_exclusive():
    result = run("bench", "store", "--store", "/tmp/x", "--standin", "s3", *SMALL)
    assert result.exit_code != 0
    assert "give --store or --standin, not both" in result.output


def test_unsupported_store_is_one_line_with_the_fix():
    result = run("bench", "store", "--store", "ftp://host/x", *SMALL)
    assert result.exit_code == 1
    assert "has no create-only write; use a local path" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("text", "size"), [("1024", 1024), ("64MiB", 64 << 20), ("64M", 64 << 20), ("2MB", 2_000_000)]
)
def test_sizes_parse(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "-1", "0", "0.5", "1000", "12 parsecs"])
def test_bad_sizes_say_what_is_allowed(text):
    result = run("bench", "store", "--size", text)
    assert result.exit_code == 2
    assert "give at least 1024 bytes" in result.output


@pytest.mark.integration
@pytest.mark.parametrize(
    ("mode", "replicas", "up", "down"),
    [
        ("gather", 3, 1, 2),  # up P, down (n - 1) P
        ("sharded", 4, 1.25, 1.5),  # up P (1 + 1/n), down 2 P (n - 1) / n
    ],
)
def test_bench_sync_json_reports_traffic_near_the_mode_bound(tmp_path, mode, replicas, up, down):
    result = run("bench", "sync", "--replicas", str(replicas), "--size", "256KiB",
                 "--rounds", "1", "--mode", mode, "--store", str(tmp_path), "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    payload = 256 * 1024
    assert report["mode"] == mode
    assert (report["bound_up_per_replica"], report["bound_down_per_replica"]) == (
        int(up * payload),
        int(down * payload),
    )
    # headers, manifests, SEAL, polls and leases cost a few percent at this small size
    for ratio in (report["up_vs_bound"], report["down_vs_bound"]):
        assert ratio >= 1
        assert ratio < 1.05
    assert report["round_seconds"] > 0
    assert report["raw_copy_seconds"] > 0
    # where a round's time went: every phase, thread-seconds, both ways of moving bytes
    assert set(report["phase_seconds"]) == set(PHASES)
    assert all(report["phase_seconds"][phase] > 0 for phase in ("transfer", "decode", "reduce"))
    assert [set(split) for split in report["phase_seconds_each"]] == [set(PHASES)]


@pytest.mark.integration
@pytest.mark.parametrize(("mode", "replicas"), [("gather", 3), ("sharded", 3)])
def test_bench_sync_of_sparse_contributions_stays_near_its_bound(tmp_path, mode, replicas):
    """16 MiB of float32 is 326 kB sparse; sharded, the reduced shards are int8 (R = 4.5 MB):
    up P + R/n, down (P + R)(n - 1)/n."""
    result = run("bench", "sync", "--replicas", str(replicas), "--size", "16MiB",
                 "--rounds", "1", "--mode", mode, "--codec", "sparse", "--store", str(tmp_path),
                 "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    numel = (16 << 20) // 4
    payload = make_codec("sparse").payload_nbytes(numel)
    reduced = make_codec("int8", block=64).payload_nbytes(numel)
    n = replicas
    bound = (payload, (n - 1) * payload) if mode == "gather" else (
        payload + reduced / n, (payload + reduced) * (n - 1) / n
    )  # fmt: skip
    assert report["payload_bytes"] == payload
    assert (report["bound_up_per_replica"], report["bound_down_per_replica"]) == tuple(
        map(int, bound)
    )
    for ratio in (report["up_vs_bound"], report["down_vs_bound"]):
        assert ratio >= 1
        assert ratio < 1.05


@pytest.mark.integration
def test_bench_sync_reports_memory_requests_and_what_waiting_costs(tmp_path):
    result = run("bench", "sync", "--replicas", "2", "--size", "256KiB", "--rounds", "1",
                 "--straggler", "1", "--store", str(tmp_path), "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["straggler_seconds"] == 1
    assert report["round_seconds"] >= 1  # the round waited for the straggler
    assert 0 < report["host_memory_added_bytes"] < 256 * 1024 * 64  # sampled, bounded
    requests = report["requests_by_kind_per_replica"]
    assert requests["gets"] > 1  # the waiting replica polled
    assert report["requests_per_replica"] == sum(requests.values())
    assert report["s3_request_usd_per_1000_rounds_per_replica"] > 0


@pytest.mark.integration
def test_bench_sync_through_a_shaped_wan_link_cannot_beat_the_link():
    """Each replica reaches moto through its own shaped link; a round moves at least its
    bytes over its link, so it takes at least (up + down) / link."""
    result = run("bench", "sync", "--replicas", "2", "--size", "1MiB", "--rounds", "1",
                 "--standin", "s3", "--bandwidth", "4MB", "--latency", "0.02", "--link", "8MB",
                 "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["wan"] == {"bandwidth": 4_000_000, "latency": 0.02, "link": 8_000_000}
    assert report["link_bound_seconds"] == pytest.approx(
        (report["bytes_up_per_replica"] + report["bytes_down_per_replica"]) / 8e6
    )
    assert report["round_vs_link_bound"] >= 1
    # the table a terminal gets from the same report: the round, its bound and its split
    console = Console(width=200, record=True)
    console.print(sync_table(report))
    shown = console.export_text()
    assert f"link bound {report['link_bound_seconds']:.2f} s" in shown
    assert f"decode {report['phase_seconds']['decode']:.3f}" in shown
    assert f"{report['round_seconds']:.3f}" in shown


@pytest.mark.integration
def test_bench_sync_says_in_a_line_why_its_replica_failed():
    """A replica process that fails (here: a store the parent never opens) is reported with
    its own error, at once, instead of the parent waiting for it or printing a traceback."""
    result = run("bench", "sync", "--replicas", "1", "--size", "256KiB", "--store",
                 "nosuchproto://bucket")  # fmt: skip
    assert result.exit_code == 1
    assert "error: replica r0 failed: ValueError: Protocol not known: nosuchproto" in (
        result.output
    )
    assert "Traceback" not in result.output


def test_bench_sync_wan_needs_a_standin(tmp_path):
    result = run("bench", "sync", "--store", str(tmp_path), "--bandwidth", "25MB")
    assert result.exit_code == 2
    assert "--bandwidth shapes a stand-in's link: give --standin s3" in result.output


@pytest.mark.parametrize(
    ("option", "message"), [("--mode=ring", "this build has gather, sharded, auto"),
                            ("--codec=fp4", "fp4"), ("--device=tpu", "'tpu': cpu or cuda")]
)  # fmt: skip
def test_bench_sync_rejects_what_it_cannot_run(option, message):
    result = run("bench", "sync", option)
    assert result.exit_code == 2
    assert message in result.output


def study_report(*options: str) -> dict:
    """``diloco bench convergence`` with ``options``, run to a good end: its JSON report."""
    result = run("bench", "convergence", *options, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.integration
def test_bench_convergence_sweeps_from_a_warm_start_against_data_parallel(tmp_path, monkeypatch):
    """Two outer learning rates at N = 1 and 2 from one warm start: four DiLoCo runs, each
    against the data-parallel run of its N (plain AdamW at N = 1) at equal tokens, with their
    curves in one table, one JSON and one PNG."""
    monkeypatch.chdir(tmp_path)
    report = study_report("--replicas", "1,2", "--sync-every", "5", "--outer-lr", "0.5,0.7",
                          "--steps", "10", "--warm-start", "5", "--codec", "fp32",
                          "--plot", "study.png")  # fmt: skip
    assert report["warm_start_eval_loss"] < math.log(256)  # trained: below an untrained model's
    baselines = {b["replicas"]: b for b in report["baselines"]}
    assert [(r["replicas"], r["outer_lr"]) for r in report["runs"]] == [
        (1, 0.5), (1, 0.7), (2, 0.5), (2, 0.7)
    ]  # fmt: skip
    for run_ in report["runs"]:
        baseline = baselines[run_["replicas"]]
        tokens = [tokens for tokens, _ in run_["curve"]]
        assert tokens == [tokens for tokens, _ in baseline["curve"]]  # evaluated at equal tokens
        assert run_["eval_loss"] == run_["curve"][-1][1]
        assert run_["eval_loss_ratio"] == run_["eval_loss"] / baseline["eval_loss"]
        assert run_["eval_loss"] < report["warm_start_eval_loss"]  # trained on from it
        assert 0.8 < run_["eval_loss_ratio"] < 1.25  # near its baseline: the outer step works
    assert report["runs"][0]["fewer_bytes"] is None  # one replica sends nothing to compare
    assert report["runs"][2]["fewer_bytes"] > 3  # ten steps of gradients against two syncs
    assert (tmp_path / "study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    uneven = run("bench", "convergence", "--sync-every", "3", "--steps", "10")
    assert uneven.exit_code != 0
    assert "steps (10) must be a multiple of every H (3)" in uneven.output


RECORDING_TASK = """
import os
from diloco_anywhere.tasks import gpt


def build(context):
    with open(os.environ["TOTAL_STEPS_LOG"], "a") as log:
        log.write(f"{context.total_steps}\\n")
    return gpt.build(context)
"""


@pytest.mark.integration
def test_every_model_of_a_study_is_built_knowing_its_runs_length(tmp_path, monkeypatch):
    """A study trains the task a run.toml names, with its options; a task's learning-rate
    schedule runs over ``total_steps``: the warm start's, the baseline's and the replicas'
    models are each told the length of their own run."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recording_task.py").write_text(RECORDING_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))  # the study's own processes (spawned)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("TOTAL_STEPS_LOG", str(tmp_path / "total_steps.log"))
    (tmp_path / "run.toml").write_text(
        '[task]\nentrypoint = "recording_task:build"\n'
        '[task.options]\npreset = "tiny"\nbatch_size = 4\ncorpus_bytes = 200000\n'
    )
    report = study_report("--config", "run.toml", "--replicas", "1", "--sync-every", "5",
                          "--steps", "10", "--warm-start", "5")  # fmt: skip
    logged = (tmp_path / "total_steps.log").read_text().split()
    assert logged == ["5", "10", "10"]  # warm start, plain AdamW, the DiLoCo replica
    # the study trained the run.toml's task, as its options say: batches of 4 of 64 tokens
    assert report["task"] == {"preset": "tiny", "batch_size": 4, "corpus_bytes": 200000}
    tokens = [tokens for tokens, _ in report["runs"][0]["curve"]]
    assert tokens == [5 * 4 * 64, 10 * 4 * 64], tokens


@pytest.mark.integration
def test_bench_convergence_studies_streaming_diloco_and_plain_sgd_outer_steps(
    tmp_path, monkeypatch
):
    """Fragments are a swept setting; momentum 0 is plain SGD (Nesterov needs momentum)."""
    monkeypatch.chdir(tmp_path)
    report = study_report("--replicas", "2", "--sync-every", "4", "--fragments", "2",
                          "--fragment-delay", "1", "--outer-momentum", "0", "--steps", "8",
                          "--codec", "fp32")  # fmt: skip
    assert report["study"]["fragment_delay"] == 1
    (streaming,) = report["runs"]
    assert (streaming["fragments"], streaming["outer_momentum"]) == (2, 0.0)
    (baseline,) = report["baselines"]
    tokens = [tokens for tokens, _ in streaming["curve"]]
    assert tokens == [tokens for tokens, _ in baseline["curve"]] == [tokens[0], 2 * tokens[0]]
    assert 0 < streaming["eval_loss_ratio"] < 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--sync-every", "5", "--fragments", "2", "--steps", "10"),
         "sync_every (5) must be a multiple of fragments (2)"),
        (("--sync-every", "4", "--fragments", "2", "--fragment-delay", "2", "--steps", "8"),
         "fragment_sync_delay (2) must be less than sync_every / fragments (2)"),
    ],
)  # fmt: skip
def test_bench_convergence_refuses_a_streaming_schedule_diloco_cannot_run(options, message):
    result = run("bench", "convergence", *options)
    assert result.exit_code != 0
    assert message in result.output


@pytest.mark.integration
def test_bench_overlap_and_throughput_report_fractions_and_ratios(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overlap = run("bench", "overlap", "--replicas", "2", "--sync-every", "4", "--outer-steps",
                  "2", "--fragments", "2", "--delay", "1", "--json")  # fmt: skip
    assert overlap.exit_code == 0, overlap.output
    report = json.loads(overlap.stdout)
    assert report["streaming"]["fragments"] == 2
    for name in ("blocking", "streaming"):
        assert 0 < report[name]["exposed_fraction"] < 1
    throughput = run("bench", "throughput", "--sync-every", "5", "--outer-steps", "2",
                     "--repeats", "1", "--json")  # fmt: skip
    assert throughput.exit_code == 0, throughput.output
    assert json.loads(throughput.stdout)["ratio"] > 0


def _command_paths(command: object, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command's argument path, groups walked (``typer.core.TyperGroup`` has
    ``commands``)."""
    commands = getattr(command, "commands", None)
    if commands is None:
        return [path]
    return [found for name, sub in commands.items() for found in _command_paths(sub, (*path, name))]


@pytest.mark.parametrize("path", _command_paths(typer.main.get_command(app)), ids=" ".join)
def test_every_help_is_readable_at_80_columns(path):
    """Option descriptions get the width of the terminal, not a squeezed column."""
    result = runner.invoke(app, [*path, "--help"], terminal_width=80)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(map(len, lines)) <= 80
    options = lines[lines.index("Options:") + 1 :]
    described = [line for line in options if re.match(r"  -\S.*?\s{2,}\S", line)]
    assert described, "no option with its description beside it"
    for line in described:
        assert re.match(r"  -\S.*?\s{2,}", line).end() <= 34, line


def test_status_and_logs_of_a_run_never_launched_say_so(run_toml):
    """Before any launch there is nothing to show: status says so in a line (not an empty
    table), and logs of an unknown replica name what there is to ask for."""
    config = run_toml()
    status = run("status", "--config", config)
    assert status.exit_code == 0, status.output
    assert "run t: no replicas launched or reporting yet" in status.stdout
    logs = run("logs", "local-9", "--config", config)
    assert logs.exit_code != 0
    assert "no replica 'local-9' in this run's launch; replicas: none launched from here" in (
        logs.output
    )
