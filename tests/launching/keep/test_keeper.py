"""``diloco keep | replace`` and alerts: the keeper's decisions, its records in the bucket, and
what it does to real local replica processes."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.policy import LeasePolicy
from diloco_anywhere.config import AlertsSection, KeepSection, load_config
from diloco_anywhere.launching.keep.alerts import Alert, Alerts, webhook_body
from diloco_anywhere.launching.keep.decisions import LAUNCH_GRACE, Observed, decide
from diloco_anywhere.launching.keep.health import health_alerts
from diloco_anywhere.launching.keep.keeper import Keeper, store_time
from diloco_anywhere.launching.start.launch import load_handles, plan_launch, run_launches, start
from diloco_anywhere.launching.start.launches import JobRecord, RestartRecord
from diloco_anywhere.training.records.metrics import EventLine, ReplicaMetrics
from support.runs import diloco, statuses

KEEP = KeepSection(max_restarts=3, backoff=60, max_backoff=300, stable_after=600, hung_after=900)
NOW = 100_000.0


def job(attempt: int = 0) -> JobRecord:
    return JobRecord(replica_id="modal-0", platform="modal", attempt=attempt,
                     job={"call_id": "fc-1"}, started_at=0.0)  # fmt: skip


def claim(
    attempt: int, counted: int = 0, streak: int = 0, contributions: int = 0, fruitless: int = 0
) -> RestartRecord:
    return RestartRecord(replica_id="modal-0", attempt=attempt, reason="failed", detail="",
                         counted=counted, streak=streak, host="ci", at=0.0, nonce="n",
                         contributions=contributions, fruitless=fruitless)  # fmt: skip


def seen(**fields) -> Observed:
    """modal-0 on its first attempt, started an hour ago, leasing until a minute ago."""
    base = Observed(
        replica_id="modal-0", platform="modal", attempt=0, job=job(), state="running",
        exit_code=None, stopped=False, claim=None, claimed_at=None, started_at=NOW - 3600,
        active_at=NOW - 60, done=False,
    )  # fmt: skip
    return replace(base, **fields)


# -- decisions ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "action"),
    [
        ({}, "leave"),  # running, leasing
        ({"state": "pending", "active_at": None}, "leave"),  # queued for capacity
        ({"state": "unknown", "active_at": NOW - 5000}, "leave"),  # its platform cannot say
        ({"state": "failed", "stopped": True}, "leave"),  # `diloco stop`
        ({"state": "exited", "done": True}, "leave"),
        ({"state": "failed", "exit_code": 3}, "leave"),  # superseded: a newer one runs
    ],
)
def test_a_replica_that_may_still_run_or_ended_on_purpose_is_left_alone(fields, action):
    assert decide(seen(**fields), NOW, KEEP).action == action


@pytest.mark.parametrize("state", ["failed", "timed_out", "stopped", "exited"])
def test_an_attempt_that_ran_a_while_and_ended_is_restarted_at_once(state):
    decision = decide(seen(state=state), NOW, KEEP)
    assert (decision.action, decision.reason, decision.streak) == ("restart", state, 0)
    assert decision.detail == f"its modal job {state}"


def test_a_timed_out_attempt_is_planned_and_not_counted_against_the_budget():
    previous = claim(attempt=3, counted=3)  # the budget (3) is spent on failures
    timed_out = seen(state="timed_out", attempt=3, job=job(3), claim=previous)
    assert (decide(timed_out, NOW, KEEP).action, decide(timed_out, NOW, KEEP).counted) == (
        "restart", 3,
    )  # fmt: skip
    failed = decide(replace(timed_out, state="failed"), NOW, KEEP)
    assert failed.action == "give_up"
    assert failed.detail.endswith("out of restarts ([keep] max_restarts = 3)")


def test_quick_ends_in_a_row_wait_longer_each_time_up_to_the_cap():
    """The wait counts from the attempt's end (its last lease), in the store's time."""
    waits = []
    for streak in range(5):
        quick = seen(state="failed", started_at=NOW - 30, active_at=NOW - 20,
                     claim=claim(attempt=1, streak=streak), attempt=1, job=job(1))  # fmt: skip
        decision = decide(quick, NOW, KEEP)
        assert (decision.action, decision.streak) == ("wait", streak + 1)
        waits.append(int(decision.detail.rpartition("restarting in ")[2].split()[0]))
    assert waits == [40, 100, 220, 280, 280]  # 60, 120, 240, 300, 300 after the end, 20 s ago
    later = seen(state="failed", started_at=NOW - 400, active_at=NOW - 390,
                 claim=claim(1, streak=2), attempt=1, job=job(1))  # fmt: skip
    assert decide(later, NOW, KEEP).action == "restart"  # 240 s have passed


def test_a_running_job_whose_lease_went_silent_is_hung_and_replaced():
    decision = decide(seen(active_at=NOW - 1000), NOW, KEEP)
    assert (decision.action, decision.reason, decision.stop_first) == ("restart", "hung", True)
    never_claimed = seen(active_at=None, started_at=NOW - 1000)  # stuck before it joined
    assert decide(never_claimed, NOW, KEEP).reason == "hung"


def test_a_claimed_attempt_is_being_started_until_its_grace_ends_then_counts_as_lost():
    starting = seen(state="failed", claim=claim(attempt=1), claimed_at=NOW - 30, attempt=1)
    assert decide(starting, NOW, KEEP).action == "leave"
    lost = replace(starting, claimed_at=NOW - LAUNCH_GRACE - 1)
    decision = decide(lost, NOW, KEEP)
    assert (decision.reason, decision.counted) == ("lost", 1)
    assert "never started" in decision.detail


@pytest.mark.parametrize(
    ("code", "why"),
    [(2, "it refused run.toml"),
     (4, "its script trains without syncing (outside `replica.diloco`, a Trainer without "
         "DilocoCallback, or another optimizer than the one DiLoCo wraps)"),
     (5, "its model is unlike the run's"),
     (6, "too few replicas are left for a round (the others stopped for good)")],
)  # fmt: skip
def test_a_replica_whose_end_no_restart_can_help_is_not_restarted(code, why):
    """Each is out for good but the one that ended for the others' doing (exit 6): once they
    are replaced, it can come back, so its departure does not count against the run."""
    decision = decide(seen(state="failed", exit_code=code), NOW, KEEP)
    assert decision.action == "give_up"
    assert f"{why} and would only fail again; fix it, then `diloco replace modal-0`" in (
        decision.detail
    )
    assert decision.final == (code != 6)


def test_attempts_that_end_before_contributing_are_bounded_whatever_ended_them():
    """The issue's keeper that restarted forever: each HF Jobs attempt ended at its time
    limit before it contributed (not counted against max_restarts). Past max_fruitless in a
    row it is not restarted, and the message says what each took and the fix."""
    fruitless = []
    for attempt in range(1, 6):
        previous = claim(attempt, contributions=12, fruitless=attempt - 1)
        ended = seen(state="timed_out", attempt=attempt, job=job(attempt), claim=previous,
                     contributions=12, heal_seconds=2400.0)  # fmt: skip
        decision = decide(ended, NOW, KEEP)
        fruitless.append((decision.action, decision.fruitless, decision.counted))
        if decision.action == "give_up":
            break
    assert fruitless == [("restart", 1, 0), ("restart", 2, 0), ("restart", 3, 0),
                         ("give_up", 0, 0)]  # fmt: skip
    assert decision.detail == (
        "4 attempts of modal-0 in a row, none contributed to a round: the last ended (its "
        "modal job timed_out) after 3540 s; its last heal took 2400 s; give its attempts a "
        "longer time limit ([backends.modal]) than its start and heal take, then `diloco "
        "replace modal-0`"
    )


def test_an_attempt_that_contributed_starts_the_count_again():
    previous = claim(3, contributions=12, fruitless=3)
    contributed = seen(state="timed_out", attempt=3, job=job(3), claim=previous, contributions=13)
    decision = decide(contributed, NOW, KEEP)
    assert (decision.action, decision.fruitless) == ("restart", 0)
    crashed = decide(replace(contributed, state="failed", contributions=12), NOW, KEEP)
    assert crashed.action == "give_up"
    assert "see `diloco logs modal-0`, fix it, then `diloco replace modal-0`" in crashed.detail


# -- alerts -----------------------------------------------------------------------------------


def test_an_alert_observed_by_several_is_sent_once(tmp_path, webhook):
    store, layout = Store(str(tmp_path)), RunLayout("r")
    observers = [Alerts(store, layout, 0, AlertsSection()) for _ in range(4)]
    threads = [threading.Thread(target=o.send, args=(Alert("ended.modal-0.0", "gone"),))
               for o in observers]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert webhook.texts() == ["[r] gone"]
    assert [a.text for a in observers[0].recorded()] == ["gone"]


def test_a_refused_alert_is_given_back_and_sent_by_a_later_pass(tmp_path, webhook, caplog):
    alerts = Alerts(Store(str(tmp_path)), RunLayout("r"), 0, AlertsSection())
    webhook.refuse = 1
    with caplog.at_level(logging.WARNING):
        assert not alerts.send(Alert("end.done", "run r ended"))
    assert webhook.url not in caplog.text  # the URL is a secret
    assert "alert end.done not sent" in caplog.text
    assert alerts.send(Alert("end.done", "run r ended"))
    assert not alerts.send(Alert("end.done", "run r ended"))
    assert webhook.texts() == ["[r] run r ended"]


def test_without_a_webhook_alerts_are_recorded_and_not_sent(tmp_path, monkeypatch):
    monkeypatch.delenv("DILOCO_ALERT_WEBHOOK", raising=False)
    alerts = Alerts(Store(str(tmp_path)), RunLayout("r"), 0, AlertsSection())
    assert alerts.send(Alert("stalled.start", "no round"))
    assert [record.event for record in alerts.recorded()] == ["stalled.start"]


def test_discord_reads_content_and_everyone_else_text():
    assert json.loads(webhook_body("https://discord.com/api/webhooks/1/x", "hi")) == {
        "content": "hi"
    }
    assert json.loads(webhook_body("https://hooks.slack.com/services/T/B/x", "hi")) == {
        "text": "hi"
    }


def test_health_alerts_name_too_few_live_replicas_a_stall_and_a_divergence(tmp_path):
    config = load_config()  # min_replicas 2, stalled_after 1800 s
    expiry = LeasePolicy(period=config.sync.lease_period).expiry
    store, layout = Store(str(tmp_path)), RunLayout(config.run.name)
    now = store_time(store, layout)
    live = {"local-0": now - 1, "local-1": now - expiry + 1}
    assert health_alerts(store, layout, config, live, {}, now, now - 4000) == [
        Alert("stalled.start", "no round has sealed for 67 min (since the launch; [alerts] "
              "stalled_after = 1800 s)")
    ]  # fmt: skip
    starting = health_alerts(store, layout, config, {"local-0": None}, {}, now, now - 100)
    assert starting == []  # within stalled_after of the launch: replicas are still starting
    down = {"local-0": now - 1, "local-1": now - expiry - 1}
    diverged = ReplicaMetrics("local-1", events=[EventLine(event="diverged", time=now)])
    alerts = health_alerts(store, layout, config, down, {"local-1": diverged}, now, now - 4000)
    assert [alert.event for alert in alerts] == ["quorum.start", "stalled.start",
                                                 "diverged.local-1.1"]  # fmt: skip
    assert alerts[0].text == (
        "1 replicas live (local-0), fewer than run.min_replicas = 2: no round can seal"
    )


# -- the keeper on local replicas ------------------------------------------------------------


def _kill(handles) -> None:
    for handle in handles:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(handle.job["pid"], signal.SIGKILL)


@pytest.mark.integration
def test_keepers_racing_start_an_ended_replica_once(run_toml):
    config = load_config(run_toml(replicas=2, outer_steps=200))
    plan = plan_launch(config, {"local": 2})
    started = start(plan)
    try:
        _kill([started["local"][1][0]])
        store = Store(config.store_url())
        keepers = [Keeper(config, store, backends={"local": started["local"][0]})
                   for _ in range(3)]  # fmt: skip
        deadline = time.monotonic() + 60
        while load_handles(config)[0].job["pid"] == started["local"][1][0].job["pid"]:
            assert time.monotonic() < deadline
            threads = [threading.Thread(target=k.pass_) for k in keepers]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        launch = run_launches(config).latest()
        assert launch is not None
        assert (launch.jobs["local-0"].attempt, launch.restarts["local-0"].attempt) == (1, 1)
        assert "local-1" not in launch.restarts
        layout = RunLayout(config.run.name)
        restarts = store.list_prefix(f"{layout.launch_folder(launch.number)}/restarts")
        assert len(restarts) == 1
        # a launch following its run passes every 2 s, and writes the page every page_every
        written = store.modified(layout.status_page())
        Keeper(config, store, backends={"local": started["local"][0]}, page_every=3600.0).pass_()
        assert store.modified(layout.status_page()) == written
    finally:
        _kill(load_handles(config) + started["local"][1])


@pytest.mark.integration
def test_keep_ends_a_done_run_and_says_so_every_pass(run_toml):
    config = run_toml(replicas=2, outer_steps=2)
    assert diloco("launch", "--config", config).exit_code == 0
    for _ in range(2):
        result = diloco("keep", "--config", config)
        assert result.exit_code == 0, result.output
        assert "launch 0 has ended (done: the last outer step is committed)" in result.output
    launch = run_launches(load_config(config)).latest()
    assert launch is not None
    assert launch.end is not None
    assert launch.restarts == {}
    result = diloco("status", "--config", config, "--markdown")
    assert result.exit_code == 0, result.output
    assert "| local-0 | local | done | 2 |" in result.output
    assert "| step | H | loss |" in result.output  # H: its latest round's inner steps
    assert "launch ended (done): the last outer step is committed" in result.output
    page = diloco("status", "--config", config, "--url")
    assert page.exit_code == 0, page.output
    assert page.stdout.strip().startswith("file://")
    html = Path(page.stdout.strip().removeprefix("file://")).read_text()
    assert "launch ended: done" in html  # the keeper's page
    assert "local-1" in html


@pytest.mark.integration
def test_a_budget_below_the_runs_cost_ends_it_with_the_reason_in_status(run_toml, tmp_path):
    config = run_toml(replicas=2, outer_steps=200)
    plan = plan_launch(load_config(config), {"local": 2})
    started = start(plan)
    try:
        with (tmp_path / "run.toml").open("a") as file:
            file.write("[budget]\nmax_hours = 1e-9\n")  # reached at once
        result = diloco("keep", "--config", config)
        assert result.exit_code == 0, result.output
        assert "launch 0 has ended (budget: " in result.output
        assert "[budget] max_hours" in result.output
        states = {row["state"] for row in statuses(config).values()}
        assert states == {"stopped"}, states
        shown = diloco("status", "--config", config).output
        assert "launch ended (budget)" in shown
    finally:
        _kill(started["local"][1])


@pytest.mark.integration
def test_replace_refuses_a_live_replica_and_force_starts_it_again(run_toml):
    config = run_toml(replicas=2, outer_steps=200)
    plan = plan_launch(load_config(config), {"local": 2})
    started = start(plan)
    try:
        result = diloco("replace", "local-9", "--config", config)
        assert result.exit_code == 1
        assert "no replica local-9 in launch 0; its replicas: local-0, local-1" in result.output
        result = diloco("replace", "local-1", "--config", config)
        assert result.exit_code == 1
        assert "local-1 still running: `diloco replace --force`" in result.output
        result = diloco("replace", "local-1", "--config", config, "--force")
        assert result.exit_code == 0, result.output
        assert "local-1 restarted (attempt 1): replaced by hand" in result.output
        old = started["local"][1][1]
        assert started["local"][0].state(old) != "running"  # its job was stopped first
        current = load_handles(plan.config)[1]
        assert current.job["pid"] != old.job["pid"]
        assert started["local"][0].state(current) == "running"
        assert run_launches(plan.config).latest().restarts["local-1"].reason == "replaced"
    finally:
        _kill(load_handles(plan.config) + started["local"][1])


def test_detach_with_restart_on_failure_is_refused_with_the_way_to_keep_it(run_toml):
    result = diloco("launch", "--config", run_toml(), "--detach", "--restart-on-failure")
    assert result.exit_code == 1
    assert "diloco keep --every 10m" in result.output


@pytest.mark.integration
def test_keep_dry_run_decides_and_records_nothing(run_toml):
    config = run_toml(replicas=2, outer_steps=200)
    plan = plan_launch(load_config(config), {"local": 2})
    started = start(plan)
    try:
        _kill(started["local"][1])
        deadline = time.monotonic() + 30
        while any(started["local"][0].state(h) == "running" for h in started["local"][1]):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        result = diloco("keep", "--config", config, "--dry-run", "--json")
        assert result.exit_code == 0, result.output
        decisions = json.loads(result.stdout)["decisions"]
        assert {d["action"] for d in decisions.values()} <= {"restart", "wait"}
        launch = run_launches(plan.config).latest()
        assert launch.restarts == {}
        assert launch.end is None
        assert statuses(config)["local-0"]["state"] in ("failed", "starting", "exited")
    finally:
        _kill(started["local"][1])
