"""The pieces of a run: fragments, task entrypoints, backend counts, metrics in the bucket."""

from __future__ import annotations

import dataclasses
import html
import json
import logging
import math
import sys
import time
import uuid
from datetime import datetime, timezone

import pytest
import torch
from rich.console import Console
from torch import nn

from diloco_anywhere.backends.base import ReplicaHandle
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.cli.common import print_json
from diloco_anywhere.cli.launch import parse_backends
from diloco_anywhere.cli.tables import status_table
from diloco_anywhere.collective.members.membership import Heartbeat, claim_incarnation
from diloco_anywhere.collective.policy import LeasePolicy
from diloco_anywhere.config import RunConfig
from diloco_anywhere.launching.watch.report import summarize
from diloco_anywhere.launching.watch.status import (
    OWN_DATA_FIX,
    ReplicaStatus,
    advice_lines,
    notes,
    replica_skews,
    replica_statuses,
    waiting_share,
)
from diloco_anywhere.launching.watch.status_page import PageFacts, render_page
from diloco_anywhere.task import TaskContext, build_task, load_entrypoint
from diloco_anywhere.training.builders import split_fragments
from diloco_anywhere.training.records.metrics import (
    EventLine,
    MetricsReader,
    MetricsWriter,
    StepLine,
    SyncLine,
)
from diloco_anywhere.training.state.global_state import GlobalState
from diloco_anywhere.training.state.parameter_names import stored_names
from diloco_anywhere.training.training import OWN_DATA


def tied_model() -> nn.Module:
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.Linear(16, 50, bias=False))
    model[2].weight = model[0].weight  # tied, as GPT-2's head and embedding
    return model


@pytest.mark.parametrize("count", [2, 3])
def test_fragments_hold_every_parameter_once_in_order(count):
    model = tied_model()
    fragments = split_fragments(model, count)
    held = [p for fragment in fragments for p in fragment.parameters()]
    assert len(fragments) == count
    assert [id(p) for p in held] == [id(p) for p in model.parameters()]
    assert all(list(fragment.parameters()) for fragment in fragments)


def test_fragments_balance_elements():
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)])
    sizes = [sum(p.numel() for p in f.parameters()) for f in split_fragments(model, 4)]
    assert sizes == [2 * (32 * 32 + 32)] * 4


def test_the_global_weights_are_in_place_for_a_block_and_local_weights_return_bit_for_bit():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fragments = split_fragments(model, 2)
    agreed = [{n: torch.randn_like(p) for n, p in f.named_parameters()} for f in fragments]
    state = GlobalState({}, fragments, [], stored_names(model, fragments), agreed)
    local = {name: p.detach().clone() for name, p in model.named_parameters()}

    with state.global_weights_in_place():
        for fragment, weights in zip(fragments, agreed, strict=True):
            for name, parameter in fragment.named_parameters():
                assert torch.equal(parameter, weights[name])
    with pytest.raises(RuntimeError, match="evaluation failed"), state.global_weights_in_place():
        raise RuntimeError("evaluation failed")
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, local[name])


def test_one_fragment_is_the_model_and_too_many_is_an_error():
    model = tied_model()
    assert split_fragments(model, 1) == [model]
    with pytest.raises(ValueError, match="5 fragments, but the model has 3 parameters"):
        split_fragments(model, 5)


CONTEXT = TaskContext(replica_index=0, replicas=1, seed=0, device=torch.device("cpu"))


@pytest.mark.parametrize(
    ("entrypoint", "message"),
    [
        ("no_function", "write it as 'package.module:function'"),
        ("not_a_module_anywhere:build", "cannot import 'not_a_module_anywhere'"),
        ("diloco_anywhere.task:no_such_function", "has no no_such_function()"),
    ],
)
def test_bad_task_entrypoints_say_the_fix(entrypoint, message):
    with pytest.raises(ValueError, match=message):
        load_entrypoint(entrypoint)


def test_a_task_function_must_return_a_task(tmp_path, monkeypatch):
    (tmp_path / "my_task.py").write_text("def build(context):\n    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TypeError, match="returned int; it must return a diloco_anywhere"):
        build_task("my_task:build", CONTEXT)
    sys.modules.pop("my_task", None)


MIXED = RunConfig.model_validate(
    {"run": {"replicas": 4}, "backends": {"modal": {"replicas": 2}, "k8s": {"gpus_per_pod": 1}}}
)


@pytest.mark.parametrize(
    ("values", "replicas", "counts"),
    [
        (["local"], None, {"local": 4}),
        (["local"], 3, {"local": 3}),
        (["local=2"], None, {"local": 2}),
        (["modal"], None, {"modal": 2}),  # [backends.modal] replicas
        (["modal=1", "hf_jobs=2", "local=1"], None, {"modal": 1, "hf_jobs": 2, "local": 1}),
        ([], None, {"modal": 2}),  # every [backends.*] that sets replicas
    ],
)
def test_backend_counts(values, replicas, counts):
    assert parse_backends(values, MIXED, replicas) == counts


def test_without_backends_in_run_toml_the_default_is_local():
    assert parse_backends([], RunConfig(), None) == {"local": 4}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["mainframe"], "choose from local, modal, hf_jobs, sagemaker, k8s"),
        (["local", "local"], "give each a count"),
        (["local=0"], "whole number >= 1"),
    ],
)
def test_bad_backend_counts_say_what_is_allowed(values, message):
    with pytest.raises(ValueError, match=message):
        parse_backends(values, RunConfig(), None)


def _sync(outer_step: int, eval_loss: float | None) -> SyncLine:
    return SyncLine(
        outer_step=outer_step, committed=True, participants=2, eval_loss=eval_loss, tokens=100,
        tokens_per_second=10.0, sync_exposed_seconds=0.5, bytes_up=10, bytes_down=20, time=1.0,
    )  # fmt: skip


def test_metrics_round_trip_through_the_store_and_skip_a_corrupt_chunk(caplog):
    store, layout = Store("memory://metrics-round-trip"), RunLayout("run")
    writer = MetricsWriter(store, layout, "local-0", 0, "local")
    writer.event("started", parameters=1234)
    writer.add(StepLine(step=5, loss=3.0, tokens=100, time=1.0))
    writer.add(_sync(1, 2.5))
    writer.flush()
    store.put(layout.metrics_chunk("local-1", 0, 0), b"DLAR garbage")
    reader = MetricsReader(store, layout)
    with caplog.at_level(logging.WARNING):
        replicas = reader.read()
    assert list(replicas) == ["local-0"]
    metrics = replicas["local-0"]
    assert (metrics.parameters(), metrics.latest_eval_loss(), metrics.state()) == (
        1234, 2.5, "started",
    )  # fmt: skip
    assert [s.loss for s in metrics.steps] == [3.0]
    assert "skipping metrics chunk: run/metrics/local-1/000000-00000000" in caplog.text
    writer.event("done")
    assert reader.read()["local-0"].state() == "done"  # new chunks are picked up


def test_a_metrics_chunk_at_another_replicas_key_is_skipped(caplog):
    store, layout = Store("memory://metrics-misplaced"), RunLayout("run")
    MetricsWriter(store, layout, "local-0", 0, "local").event("started")
    data = store.get(layout.metrics_chunk("local-0", 0, 0))
    store.put(layout.metrics_chunk("local-1", 0, 0), data)  # copied under another replica
    with caplog.at_level(logging.WARNING):
        assert list(MetricsReader(store, layout).read()) == ["local-0"]
    assert "run/metrics/local-1/000000-00000000: chunk of run/local-0 belongs at" in caplog.text


def test_a_restarted_replica_sums_its_incarnations_and_reports_its_newest_state():
    """Counters are per process: a replica that restarted sent what both incarnations sent.
    Its state is its newest incarnation's; status counts the restart and the heal."""
    store, layout = Store("memory://metrics-incarnations"), RunLayout("run")
    first = MetricsWriter(store, layout, "local-0", 0, "local")
    first.event("started", parameters=10)
    first.add(_sync(1, None))
    first.flush()  # then SIGKILL: no "done", no "failed"
    second = MetricsWriter(store, layout, "local-0", 1, "local")
    second.event("started", parameters=10)
    second.event("healed", "healed from checkpoint 0", seconds=0.5)
    second.add(_sync(2, 2.5))
    second.event("done")
    metrics = MetricsReader(store, layout).read()
    replica = metrics["local-0"]
    assert (replica.incarnations, replica.state(), replica.count("healed")) == ([0, 1], "done", 1)
    summary = summarize(metrics)
    assert (summary.bytes_up_per_replica, summary.bytes_down_per_replica) == (20, 40)
    assert summary.sync_exposed_seconds == 1.0
    [row] = replica_statuses(metrics, [], lambda handle: "unknown")
    assert (row.state, row.restarts, row.heals, row.divergences) == ("done", 1, 1, 0)


def test_a_restart_that_heals_to_the_end_shows_the_outer_step_its_heal_reached():
    """It syncs nothing more, so no sync line says where it is: its heal and its done do."""
    store, layout = Store("memory://metrics-healed-to-the-end"), RunLayout("run")
    first = MetricsWriter(store, layout, "local-0", 0, "local")
    first.add(_sync(7, None))
    first.flush()
    second = MetricsWriter(store, layout, "local-0", 1, "local")
    second.event("healed", "healed from checkpoint 15: replayed 1 rounds", outer_step=16)
    second.event("done", "16 outer steps", outer_step=16)
    metrics = MetricsReader(store, layout).read()
    [row] = replica_statuses(metrics, [], lambda handle: "unknown")
    assert (row.state, row.outer_step) == ("done", 16)
    assert summarize(metrics).outer_steps == 16


@pytest.mark.parametrize(("job", "state"), [("exited", "done"), ("failed", "failed"),
                                            ("running", "done"), ("unknown", "done")])  # fmt: skip
def test_a_replica_done_training_whose_script_then_failed_is_shown_failed(job, state):
    store, layout = Store(f"memory://status-done-{job}"), RunLayout("run")
    MetricsWriter(store, layout, "local-0", 0, "local").event("done", outer_step=2)
    handle = ReplicaHandle("local-0", "local", {"pid": 1})
    [row] = replica_statuses(MetricsReader(store, layout).read(), [handle], lambda _: job)
    assert row.state == state


def _bucket_says(what: str) -> dict:
    """A replica's metrics as the bucket holds them: nothing yet, its start only, or steps."""
    if what == "nothing":
        return {}
    store, layout = Store(f"memory://status-{uuid.uuid4().hex}"), RunLayout("run")
    writer = MetricsWriter(store, layout, "local-0", 0, "local")
    writer.event("started")
    if what == "steps":
        writer.add(StepLine(step=1, loss=2.0, tokens=10, time=1.0))
        writer.flush()
    return MetricsReader(store, layout).read()


@pytest.mark.parametrize("bucket", ["nothing", "started", "steps"])
@pytest.mark.parametrize("job", ["exited", "failed", "stopped"])
@pytest.mark.parametrize("stopped_on_purpose", [False, True])
def test_a_replica_whose_job_ended_is_never_shown_starting_or_running(
    bucket, job, stopped_on_purpose
):
    """A replica killed before its first metrics line (or after its last) wrote nothing saying
    it ended: its platform's word that the job ended decides, and `diloco stop` shows."""
    handle = ReplicaHandle("local-0", "local", {"pid": 1})
    stopped = {"local-0"} if stopped_on_purpose else set()
    [row] = replica_statuses(_bucket_says(bucket), [handle], lambda _: job, stopped)
    assert row.state == ("stopped" if stopped_on_purpose else job)


@pytest.mark.parametrize(("bucket", "shown"), [("nothing", "starting"), ("steps", "running")])
def test_a_running_job_is_starting_until_its_first_step(bucket, shown):
    handle = ReplicaHandle("local-0", "local", {"pid": 1})
    [row] = replica_statuses(_bucket_says(bucket), [handle], lambda _: "running", {"local-0"})
    assert row.state == shown


def test_non_finite_metrics_stay_readable_end_to_end():
    """A loss that went NaN and an eval loss that overflowed are what a user most needs to see:
    they round-trip through the bucket, and every later line with them."""
    store, layout = Store("memory://metrics-non-finite"), RunLayout("run")
    writer = MetricsWriter(store, layout, "local-0", 0, "local")
    writer.event("started")
    writer.add(StepLine(step=5, loss=float("nan"), tokens=100, time=1.0))
    writer.add(_sync(1, float("inf")))
    writer.add(_sync(2, 2.5))
    writer.flush()
    metrics = MetricsReader(store, layout).read()["local-0"]
    assert math.isnan(metrics.steps[0].loss)
    assert [s.eval_loss for s in metrics.syncs] == [float("inf"), 2.5]


def test_json_for_scripts_is_standard_json_whatever_the_floats(capsys):
    print_json({"loss": float("nan"), "rows": [{"ratio": float("-inf")}, (1.5, float("inf"))]})
    text = capsys.readouterr().out

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    assert json.loads(text, parse_constant=refuse) == {
        "loss": None, "rows": [{"ratio": None}, [1.5, None]],
    }  # fmt: skip


@pytest.mark.parametrize("skew", [-300.0, 31.0])
def test_status_shows_a_replicas_clock_skew_and_counts_last_seen_in_the_stores_time(skew):
    """A replica whose clock is off writes times off by as much; its lease says by how much,
    and status shows it and takes it out of "last seen". Its newest line is 10 s old: the
    skew's measure is off by up to half a round trip to the store (milliseconds), which must
    not show a line just written as seen in the future (``_seconds_since`` says 0 then)."""
    store, layout = Store(f"memory://status-skew-{skew}"), RunLayout("run")
    heartbeat = Heartbeat(
        store, layout, claim_incarnation(store, layout, "local-0"), LeasePolicy(),
        lambda: time.time() + skew,
    )  # fmt: skip
    heartbeat.beat()  # measures
    heartbeat.beat()  # writes it
    writer = MetricsWriter(store, layout, "local-0", 0, "local")
    writer.add(StepLine(step=1, loss=2.0, tokens=10, time=time.time() + skew - 20))
    writer.add(EventLine(event="superseded", time=time.time() + skew - 10))
    writer.flush()
    skews = replica_skews(store, layout)
    assert skews["local-0"] == pytest.approx(skew, abs=1.0)
    [row] = replica_statuses(MetricsReader(store, layout).read(), [], lambda _: "unknown",
                             skews=skews)  # fmt: skip
    assert 9 <= row.last_seen_seconds < 15  # not 5 minutes more, nor 31 s into the future
    assert row.superseded == 1
    console = Console(width=200, record=True)
    console.print(status_table([row], "t"))
    shown = console.export_text()
    assert f"clock {skew:+.0f}s" in shown
    assert "superseded 1x" in shown


def test_a_line_just_written_is_seen_now_not_in_the_future():
    """A skew measured a few milliseconds short (half a round trip to the store, at most) puts
    the newest line just ahead of now: status says it was seen now."""
    store, layout = Store("memory://status-just-written"), RunLayout("run")
    writer = MetricsWriter(store, layout, "local-0", 0, "local")
    writer.add(StepLine(step=1, loss=2.0, tokens=10, time=time.time() + 0.05))
    writer.flush()
    [row] = replica_statuses(MetricsReader(store, layout).read(), [], lambda _: "unknown",
                             skews={"local-0": 0.0})  # fmt: skip
    assert row.last_seen_seconds == 0.0


def test_the_status_table_says_which_replicas_wait_on_the_others_and_which_hold_them_up():
    waiting = dataclasses.replace(_row("modal-0", "modal", "running"), waiting=0.62)
    slow = dataclasses.replace(_row("sagemaker-0", "sagemaker", "running"), behind=True,
                               waiting=0.05)  # fmt: skip
    console = Console(width=200, record=True)
    console.print(status_table([waiting, slow], "t"))
    lines = console.export_text().splitlines()
    assert "running, waits 62%" in next(line for line in lines if "modal-0" in line)
    shown = next(line for line in lines if "sagemaker-0" in line)
    assert "running, behind" in shown
    assert "waits" not in shown  # 5% is noise


def _row(replica: str, platform: str, state: str) -> ReplicaStatus:
    return ReplicaStatus(
        replica=replica, platform=platform, state=state, outer_step=312, loss=2.4567,
        eval_loss=2.5012, tokens=10**7, tokens_per_second=123456.0, bytes_up=0, bytes_down=0,
        last_seen_seconds=12.0, restarts=2, heals=2, divergences=0, mirror_failures=0,
        superseded=0, clock_skew=None, values={}, round_steps=25,
    )  # fmt: skip


def test_the_status_table_fits_80_columns_with_whole_headers_and_numbers():
    """Eight platforms' worth of ids, a timed_out state: nothing cut with an ellipsis; the
    platform column shows only when an id does not already name its platform."""
    rows = [_row("sagemaker-0", "sagemaker", "running"), _row("hf_jobs-1", "hf_jobs", "timed_out"),
            _row("k8s-2", "k8s", "starting")]  # fmt: skip
    console = Console(width=80, record=True)
    console.print(status_table(rows, "t"))
    shown = console.export_text()
    assert "…" not in shown
    header = next(line for line in shown.splitlines() if "replica" in line)
    assert header.split() == ["replica", "state", "step", "H", "loss", "eval", "tokens/s",
                              "restarts/heals", "seen"]  # fmt: skip
    assert "timed_out  312 25 2.457 2.501  123,456            2/2  12s" in shown
    console = Console(width=80, record=True)
    slow = dataclasses.replace(_row("trainer-b", "sagemaker", "timed_out"), waiting=0.62,
                               round_steps=100)  # fmt: skip
    console.print(status_table([_row("trainer-a", "k8s", "running"), slow], "t"))
    shown = console.export_text()
    assert "…" not in shown
    assert max(map(len, shown.splitlines())) <= 80
    assert "platform" in shown
    assert "timed_out,  312 100 2.457 2.501  123,456            2/2  12s" in shown


def test_the_waiting_share_is_exposed_sync_time_over_the_recent_rounds_of_one_incarnation():
    def sync(at: float, exposed: float) -> SyncLine:
        return _sync(1, None).model_copy(update={"time": at, "sync_exposed_seconds": exposed})

    assert waiting_share([]) is None
    assert waiting_share([sync(10.0, 1.0)]) is None  # one sync: no round measured yet
    # rounds of 10 s, waiting 1, 3, then a restart (its exposed time starts again at 0.5)
    lines = [sync(0.0, 0.0), sync(10.0, 1.0), sync(20.0, 4.0), sync(30.0, 0.5), sync(40.0, 1.5)]
    assert waiting_share(lines) == pytest.approx((1 + 3 + 1) / 30)
    many = [sync(10.0 * k, 5.0 * k) for k in range(20)]  # half the time, every round
    assert waiting_share(many) == pytest.approx(0.5)


@pytest.mark.parametrize("pace", ["steps", "time"])
def test_replicas_that_wait_for_slower_ones_are_told_the_pace_fix_where_it_applies(pace):
    """A fast replica waiting 75% of its rounds on slower ones in a run paced by steps: its
    row (``--json``, status.json), the lines under ``diloco status``'s table and the page name
    ``pace = "time"``; paced by time there is nothing to change for it."""
    store, layout = Store(f"memory://status-pace-{pace}"), RunLayout("run")
    for replica, waited in (("local-0", 7.5), ("local-1", 0.2)):
        writer = MetricsWriter(store, layout, replica, 0, "local")
        for k in range(4):  # rounds of 10 s
            writer.add(
                _sync(k, None).model_copy(
                    update={"time": 10.0 * k, "sync_exposed_seconds": waited * k}
                )
            )
        writer.flush()
    metrics = MetricsReader(store, layout).read()
    fast, slow = replica_statuses(metrics, [], lambda _: "unknown", pace=pace)
    assert fast.waiting == pytest.approx(0.75)
    assert slow.advice is None
    lines = advice_lines([fast, slow])
    page = render_page([fast, slow], metrics, PageFacts("run", datetime.now(timezone.utc), "h"))
    if pace == "time":
        assert (fast.advice, lines) == (None, [])
        assert "To change" not in page
        return
    assert fast.as_dict()["advice"] == 'set [diloco] pace = "time" in run.toml: pace = "time" ' \
        "lets them train instead (docs/tuning.md)"  # fmt: skip
    assert lines == [f"local-0 (75%) wait on syncs for slower replicas: {fast.advice}"]
    assert html.escape(lines[0]) in page


def test_a_replica_whose_script_trains_on_its_own_data_is_noted_with_what_to_change():
    """A replica's newest incarnation that said ``own_data`` (its script never opened the
    run's data by its first sync): its row, its note and a line under the table; one whose
    newest incarnation opened the run's data after an older one did not says nothing."""
    store, layout = Store("memory://status-own-data"), RunLayout("run")
    for replica, incarnations in (("local-0", [True]), ("local-1", [True, False])):
        for incarnation, own in enumerate(incarnations):
            writer = MetricsWriter(store, layout, replica, incarnation, "local")
            writer.add(_sync(0, None))
            if own:
                writer.event("own_data", OWN_DATA)
            writer.flush()
    mine, theirs = replica_statuses(MetricsReader(store, layout).read(), [], lambda _: "unknown")
    assert (mine.own_data, theirs.own_data) == (OWN_DATA, None)
    assert ("quiet", "own data") in notes(mine)
    assert ("quiet", "own data") not in notes(theirs)
    assert advice_lines([mine, theirs]) == [
        f"local-0 train on their script's own data: {OWN_DATA_FIX}"
    ]
