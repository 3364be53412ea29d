"""Unattended: a run launched with ``--detach`` and left to ``diloco keep`` alone.

Replicas on three platforms (local processes, the HF Jobs stand-in, the Kubernetes stand-in)
train one run in a moto S3 bucket. The platforms' time limits end attempts within a minute or
two (HF Jobs' ``timeout``, Kubernetes' ``activeDeadlineSeconds``), replicas are SIGKILLed as a
preempted VM would be, and one is frozen (SIGSTOP) until the keeper has replaced it, then woken:
a zombie. Nothing restarts a replica but ``diloco keep``, run every ``keep_every`` seconds as a
fresh process, as cron runs it. Every figure comes from the keeper's pass reports and the run's
own metrics in its bucket:

- goodput: inner steps whose pseudo-gradient reached a committed round, over all inner steps
  run; each ended attempt is charged a full round of unrecorded steps (a lower bound);
- time to return, per restart: from the replica's last contribution to a committed round before
  its new incarnation started to the new incarnation's first one (the time the run went without
  it: noticing, backoff, the platform's start, healing, and the round it joins);
- passes to return: how many keeper passes saw a replica ended before one restarted it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco_anywhere.bench.chaos import fingerprint_disagreements, goodput
from diloco_anywhere.bench.disruptions import (
    DISRUPTIONS,
    Disrupter,
    Disruption,
    Platforms,
    following,
)
from diloco_anywhere.bench.train import Progress
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import RunConfig, load_config
from diloco_anywhere.launching.keep.alerts import Alerts
from diloco_anywhere.launching.start.launch import run_launches, run_metrics
from diloco_anywhere.standins import standin
from diloco_anywhere.standins.hf_jobs import hf_jobs_api
from diloco_anywhere.standins.kubernetes import k8s_api
from diloco_anywhere.standins.webhook import WebhookServer
from diloco_anywhere.training.records.metrics import ReplicaMetrics

DILOCO = str(Path(sys.executable).parent / "diloco")
BUCKET_SECRETS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL",
                  "AWS_DEFAULT_REGION")  # fmt: skip
PLATFORMS = ("--backend", "local=1", "--backend", "hf_jobs=1", "--backend", "k8s=1")
# a CPU-sized run in which every round needs all three replicas: it cannot end before the
# keeper has replaced each ended or frozen replica, however fast or slow the machine
RUN_TOML = """\
[run]
name = "unattended"
store = "{store}"
replicas = 3
min_replicas = 3
[diloco]
sync_every = 5
outer_steps = {outer_steps}
codec = "fp32"
inner_lr = 3e-3
[sync]
grace = 2.0
timeout = {sync_timeout}
lease_period = 1.0
[task]
log_every = 1
eval_every = 2
[task.options]
preset = "tiny"
batch_size = 4
corpus_bytes = 300000
[image]
ref = "ghcr.io/acme/run:1"
[backends.hf_jobs]
flavor = "a100-large"
timeout = "{hf_jobs_timeout}"
secrets = {secrets}
[backends.k8s]
secret = "store"
gpus_per_pod = 0
deadline_hours = {k8s_deadline_hours}
[keep]
backoff = 1.0
max_backoff = 4.0
hung_after = {hung_after}
max_restarts = 20
[alerts]
stalled_after = 30.0
"""


def unattended_toml(
    store: str, outer_steps: int = 55, hf_jobs_timeout: str = "20s", k8s_deadline_s: int = 90,
    hung_after: float = 12.0, sync_timeout: float = 60.0,
) -> str:  # fmt: skip
    """The run's run.toml: HF Jobs attempts end after ``hf_jobs_timeout``, Kubernetes Jobs
    after ``k8s_deadline_s`` seconds, the keeper restarts a replica with no sign of life for
    ``hung_after`` seconds, and a round waits ``sync_timeout`` seconds for all three."""
    return RUN_TOML.format(
        store=store, outer_steps=outer_steps, hf_jobs_timeout=hf_jobs_timeout,
        secrets=json.dumps(list(BUCKET_SECRETS)), k8s_deadline_hours=k8s_deadline_s / 3600,
        hung_after=hung_after, sync_timeout=sync_timeout,
    )  # fmt: skip


@dataclass(frozen=True)
class MachineLimits:
    """The run's limits in seconds, for how fast this machine starts a replica now."""

    hung_after: float
    hf_jobs_timeout: float
    deadline: float  # the keeper is left alone this long at most
    sync_timeout: float  # a round waits this long for a replica the keeper is replacing


def startup_seconds() -> float:
    """Seconds a fresh interpreter takes here, now, to import the replica entrypoint (torch,
    torchft and every layer): most of what starting a replica takes."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import diloco_anywhere.replica"], check=True)
    return time.perf_counter() - started


def machine_limits(startup: float, keep_every: float = 3.0) -> MachineLimits:
    """Limits that let each attempt start, claim and sync whatever the machine's speed: 12 s
    hung, 20 s per HF Jobs attempt and 600 s for the run where a replica starts in 3 s, at
    least 4, 6 and 200 start-ups. Fixed at 12 and 20, a machine three times slower and busy
    with other tests took longer than 12 s to start k8s-0, which the keeper then restarted as
    hung 18 times in a row while every HF Jobs attempt ended before a round could seal: with
    every round needing all three replicas, the run never ended.

    A round waits for all three while the keeper replaces a hung one: silent for
    ``hung_after``, seen by a pass within ``keep_every`` (the pass itself a start-up), the
    backoff (at most 4 s here), then the new attempt's start-up, its healing and its first
    inner steps (a few start-ups more). The sync timeout is that sum with room to spare, at
    least 60 s: fixed at 60 s while hung_after grew with a slow machine, the round ended
    before the replacement could join it, and the run's replicas failed."""
    hung_after = max(12.0, 4 * startup)
    replace_seconds = hung_after + keep_every + 4.0 + 6 * startup
    return MachineLimits(
        hung_after=hung_after, hf_jobs_timeout=max(20.0, 6 * startup),
        deadline=max(600.0, 200 * startup), sync_timeout=max(60.0, 2 * replace_seconds),
    )  # fmt: skip


@dataclass
class UnattendedRun:
    passes: list[dict[str, Any]] = field(default_factory=list)  # `diloco keep --json`, in order
    pass_seconds: list[float] = field(default_factory=list)  # how long each pass took
    metrics: dict[str, ReplicaMetrics] = field(default_factory=dict)
    disrupted: list[Disruption] = field(default_factory=list)  # at the round each happened
    seconds: float = 0.0  # from the first pass to the last

    def keep(self, config_path: str) -> None:
        """One keeper pass, timed."""
        started = time.monotonic()
        self.passes.append(keep_pass(config_path))
        self.pass_seconds.append(time.monotonic() - started)


CLI_SECONDS = 120  # a pass takes seconds; one still running is stuck, and says where


def cli(command: str, config_path: str, *args: str) -> str:
    """``diloco COMMAND --config CONFIG_PATH ARGS`` in a new process, in the config's folder
    (where the run's local folder lives), as a scheduler or a user runs it: its stdout."""
    try:
        done = subprocess.run(
            [DILOCO, command, "--config", config_path, *args], capture_output=True, text=True,
            timeout=CLI_SECONDS, check=False, cwd=Path(config_path).parent,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:  # what it was doing, from its own log
        said = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        raise RuntimeError(f"diloco {command} still ran after {CLI_SECONDS:g} s; its stderr "
                           f"ends: {(said or '')[-4000:]}") from None  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"diloco {command} exited {done.returncode}: {done.stderr}")
    return done.stdout


def keep_pass(config_path: str) -> dict[str, Any]:
    return json.loads(cli("keep", config_path, "--json"))


def replica_states(config_path: str) -> dict[str, str]:
    rows = json.loads(cli("status", config_path, "--json"))
    return {row["replica"]: row["state"] for row in rows}


def newest_committed(metrics: dict[str, ReplicaMetrics]) -> int:
    return max((s.round for m in metrics.values() for s in m.syncs if s.committed), default=-1)


def leave_alone(
    config_path: str,
    platforms: Platforms,
    progress: Progress,
    disruptions: tuple[Disruption, ...] = DISRUPTIONS,
    keep_every: float = 3.0,
    deadline_seconds: float = 600.0,
) -> UnattendedRun:
    """Run ``diloco keep`` every ``keep_every`` seconds on a launched run, disrupting its
    replicas as planned, until a pass ends the launch and no replica is left running (one
    restarted just before the last commit heals to it and ends by itself). The disruptions
    follow the run's progress on a thread of their own, not the keeper's passes: a pass
    takes seconds on a loaded machine, in which a short run may train past the rounds they
    are due at, even to its end."""
    config, run = load_config(config_path), UnattendedRun()
    started = time.monotonic()
    deadline = started + deadline_seconds
    disrupter, reader = Disrupter(config, platforms, disruptions), run_metrics(config)

    seen = [-1]

    def said(line: str) -> None:  # when, for a run that went otherwise than planned
        progress(f"{time.monotonic() - started:6.1f} s  {line}")

    def look() -> None:
        newest = newest_committed(reader.read())
        if newest > seen[0]:
            said(f"round {newest} committed")
            seen[0] = newest
        disrupter.step(newest, said)

    with following(look):
        try:
            while not (run.passes and run.passes[-1]["ended"]):
                _check_deadline(deadline, deadline_seconds, run.passes)
                run.keep(config_path)
                time.sleep(keep_every)
            said(f"launch ended: {run.passes[-1]['ended']}")
            while set(replica_states(config_path).values()) & {"running", "starting"}:
                _check_deadline(deadline, deadline_seconds, run.passes)
                run.keep(config_path)
                time.sleep(keep_every)
        finally:
            disrupter.wake_all()
    run.metrics, run.disrupted = reader.read(), disrupter.done
    run.seconds = time.monotonic() - started
    return run


def _check_deadline(deadline: float, seconds: float, passes: list[dict[str, Any]]) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(f"the run was not done after {seconds:g}s; last passes: {passes[-3:]}")


def restarts(run: UnattendedRun) -> list[tuple[str, str]]:
    """(replica, reason) of every restart the keeper made, in order."""
    return [(replica, decision["reason"]) for report in run.passes
            for replica, decision in report["decisions"].items()
            if decision["action"] == "restart"]  # fmt: skip


def passes_to_return(run: UnattendedRun, replica: str) -> list[int]:
    """For each restart of ``replica``: how many passes saw it ended before one restarted it
    (0: the first pass that saw it ended restarted it)."""
    waited, counts = 0, []
    for report in run.passes:
        action = report["decisions"].get(replica, {}).get("action", "leave")
        if action == "restart":
            counts.append(waited)
            waited = 0
        elif action == "wait":
            waited += 1
    return counts


def passes_left_ended(run: UnattendedRun, replica: str) -> int:
    """How many passes after ``replica``'s last restart saw it ended and did not restart it
    (waiting out a backoff, or giving up): 0 for a replica whose newest attempt ran to the end
    or ended too close to the run's end for any pass to see it."""
    left = 0
    for report in run.passes:
        action = report["decisions"].get(replica, {}).get("action", "leave")
        left = 0 if action == "restart" else left + (action in ("wait", "give_up"))
    return left


def return_seconds(metrics: ReplicaMetrics) -> list[float]:
    """Per incarnation after the first that contributed: from the replica's last contribution
    to a committed round before that incarnation started to the incarnation's first one."""
    contributed = [s.time for s in metrics.syncs if s.committed and s.contributed]
    seconds = []
    starts = [events[0].time for events in metrics.events_by_incarnation.values() if events]
    for started in starts[1:]:
        before = [t for t in contributed if t < started]
        after = [t for t in contributed if t > started]
        if before and after:
            seconds.append(min(after) - max(before))
    return seconds


def unattended_figures(run: UnattendedRun, config: RunConfig) -> dict[str, Any]:
    made = restarts(run)
    returns = [s for metrics in run.metrics.values() for s in return_seconds(metrics)]
    waits = [n for replica in run.metrics for n in passes_to_return(run, replica)]
    batches_per_round = config.diloco.sync_every // config.diloco.fragments
    return {
        "replicas": sorted(run.metrics),
        "rounds": newest_committed(run.metrics) + 1,
        "outer_steps": config.diloco.outer_steps,
        "ended": run.passes[-1]["ended"] if run.passes else None,
        "seconds": run.seconds,
        "keeper_passes": len(run.passes),
        "keeper_pass_seconds_median": statistics.median(run.pass_seconds),
        "keeper_pass_seconds_max": max(run.pass_seconds),
        "disrupted": [f"{d.how} {d.replica} after round {d.after_round}" for d in run.disrupted],
        "restarts": len(made),
        "restarts_by_reason": dict(Counter(reason for _, reason in made)),
        "passes_to_return_max": max(waits, default=None),
        "return_seconds_median": statistics.median(returns) if returns else None,
        "return_seconds_max": max(returns, default=None),
        "goodput": goodput(run.metrics, len(made), batches_per_round),
        "rounds_with_disagreeing_fingerprints": len(fingerprint_disagreements(run.metrics)),
        "done": sorted(r for r, m in run.metrics.items() if m.state() == "done"),
    }


def sent_alerts(config: RunConfig, launch_number: int) -> list[str]:
    """The alerts the keepers recorded for a launch, as the webhook shows them."""
    alerts = Alerts(Store(config.store_url()), RunLayout(config.run.name), launch_number,
                    config.alerts).recorded()  # fmt: skip
    return [f"[{config.run.name}] {alert.text}" for alert in alerts]


def store_secret(name: str, values: dict[str, str]) -> None:
    """A Secret in the current cluster's default namespace, through the real client (the
    Kubernetes backend's pods read the bucket's credentials from it)."""
    import kubernetes  # the k8s extra

    from diloco_anywhere.backends.k8s import api_client

    data = {key: base64.b64encode(value.encode()).decode() for key, value in values.items()}
    kubernetes.client.CoreV1Api(api_client(None)).create_namespaced_secret(
        "default", {"metadata": {"name": name}, "data": data}
    )


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """These variables set for this process and the commands it starts, then put back."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def bench_unattended(
    outer_steps: int, hf_jobs_timeout: str, k8s_deadline_s: int, keep_every: float,
    progress: Progress,
) -> dict[str, Any]:  # fmt: skip
    """Start the stand-ins, launch the run detached, leave it to the keeper; its figures."""
    with contextlib.ExitStack() as stack:
        progress("starting the S3, HF Jobs, Kubernetes and webhook stand-ins")
        s3 = stack.enter_context(standin("s3"))
        hub, cluster = stack.enter_context(hf_jobs_api()), stack.enter_context(k8s_api())
        webhook = WebhookServer()
        stack.callback(webhook.shutdown)
        options = s3.storage_options
        bucket = {
            "AWS_ACCESS_KEY_ID": options["key"], "AWS_SECRET_ACCESS_KEY": options["secret"],
            "AWS_ENDPOINT_URL": options["endpoint_url"], "AWS_DEFAULT_REGION": "us-east-1",
        }  # fmt: skip
        stack.enter_context(_environment({
            **bucket, "HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_standin_token",
            "KUBECONFIG": str(cluster.kubeconfig), "DILOCO_ALERT_WEBHOOK": webhook.url,
        }))  # fmt: skip
        store_secret("store", bucket)
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="diloco-bench-")))
        path = folder / "run.toml"
        path.write_text(unattended_toml(f"{s3.url}/unattended", outer_steps, hf_jobs_timeout,
                                        k8s_deadline_s))  # fmt: skip
        progress("diloco launch --detach: local, HF Jobs and Kubernetes replicas")
        cli("launch", str(path), *PLATFORMS, "--detach")
        run = leave_alone(str(path), Platforms(hub, cluster), progress, keep_every=keep_every)
        config = load_config(path)
        alerts = sent_alerts(config, run_launches(config).latest().number)
        return {
            **unattended_figures(run, config),
            "alerts_recorded": len(alerts),
            "alerts_received": len(webhook.texts()),
            "alerts": sorted(set(webhook.texts())),
        }
