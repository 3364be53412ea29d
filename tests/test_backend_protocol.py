"""What every launch relies on whatever the platform: a platform failing part-way stops what it
had started, stops carry on past failures, a platform that cannot be asked reads ``unknown``,
run.toml's platform sections are checked, and remote replicas get a store they can reach."""

from __future__ import annotations

import re

import pytest

from diloco_anywhere.backends.base import (
    PartialLaunchError,
    ReplicaHandle,
    ReplicaSpec,
    launch_each,
    one_line,
    stop_all,
)
from diloco_anywhere.cli.run import parse_backends
from diloco_anywhere.config import ConfigError, RunConfig, parse_config
from diloco_anywhere.launching.launch import check_remote_store, job_state

SPECS = [ReplicaSpec(f"x-{k}", k, "x", {}, ()) for k in range(3)]


def starter(fail_at: int, error: BaseException):
    def start_one(spec: ReplicaSpec) -> ReplicaHandle:
        if spec.index == fail_at:
            raise error
        return ReplicaHandle(spec.replica_id, "x", {"job": spec.index})

    return start_one


def test_a_platform_failing_part_way_stops_what_it_started():
    stopped = []
    with pytest.raises(PartialLaunchError) as error:
        launch_each(SPECS, starter(2, RuntimeError("quota\nexceeded")), stopped.append)
    assert [handle.replica_id for handle in stopped] == ["x-0", "x-1"]
    assert [handle.replica_id for handle in error.value.started] == ["x-0", "x-1"]
    assert str(error.value) == "quota exceeded; stopped 2 replicas (x-0, x-1)"


def test_ctrl_c_during_a_launch_stops_what_had_started_and_goes_on():
    stopped = []
    with pytest.raises(KeyboardInterrupt):
        launch_each(SPECS, starter(1, KeyboardInterrupt()), stopped.append)
    assert [handle.replica_id for handle in stopped] == ["x-0"]


def test_stops_carry_on_past_a_failing_one_and_name_it():
    def stop(handle: ReplicaHandle) -> None:
        if handle.replica_id == "x-1":
            raise ConnectionError("platform\n  unreachable")

    handles = [ReplicaHandle(s.replica_id, "x", {"job": s.index}) for s in SPECS]
    report = stop_all(handles, stop)
    assert (report.stopped, len(report.left)) == (["x-0", "x-2"], 1)
    assert str(report) == (
        "stopped 2 replicas (x-0, x-2); STILL RUNNING, stop by hand: "
        "x-1 (x job {'job': 1}: platform unreachable)"
    )


def test_a_platform_that_cannot_be_asked_reads_unknown():
    class Unreachable:
        def state(self, handle: ReplicaHandle) -> str:
            raise TimeoutError("no answer")

    assert job_state(Unreachable(), ReplicaHandle("x-0", "x")) == "unknown"


def test_one_line_keeps_sdk_errors_short():
    text = one_line(RuntimeError("(403)\nReason: Forbidden\nHTTP response body: " + "x" * 999))
    assert "\n" not in text
    assert len(text) == 400
    assert text.startswith("(403) Reason: Forbidden")


@pytest.mark.parametrize(
    ("backends", "message"),
    [
        ({"hfjobs": {"replicas": 2}}, r"\[backends.hfjobs\] in run.toml: no such platform"),
        ({"modal": {"replicas": "2"}}, r"backends.modal.replicas = '2': give a whole number"),
        ({"modal": {"replicas": True}}, r"backends.modal.replicas = True"),
    ],
)
def test_platform_sections_are_checked_before_counting(backends, message):
    config = RunConfig.model_validate({"backends": backends})
    with pytest.raises(ValueError, match=message):
        parse_backends([], config, None)


@pytest.mark.parametrize(
    ("store", "allowed"),
    [
        ("s3://bucket/runs", True),
        ("abfs://container@account.dfs.core.windows.net/runs", True),  # not a credential
        ("s3://AKIA:secret@bucket/runs", False),
        ("az://container/runs?sig=abc", False),
        ("/data/store", False),
        ("file:///data/store", False),
    ],
)
@pytest.mark.parametrize("field", ["run.store", "checkpoint.mirrors.1"])
def test_remote_replicas_need_buckets_without_credentials_in_their_urls(store, allowed, field):
    """The store and every checkpoint mirror: each is written by the replicas."""
    if field == "run.store":
        text = f'[run]\nstore = "{store}"\n'
    else:
        text = f'[run]\nstore = "s3://b/r"\n[checkpoint]\nmirrors = ["gs://m/r", "{store}"]\n'
    config = parse_config(text, "run.toml")
    if allowed:
        check_remote_store(config, ["modal"])
    else:
        with pytest.raises(ConfigError, match=re.escape(field)) as error:
            check_remote_store(config, ["modal"])
        assert "secret" not in str(error.value)
        assert "sig=abc" not in str(error.value)
