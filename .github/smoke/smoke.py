"""The smoke run of .github/workflows/smoke.yml: 2 replicas x 2 rounds on one platform.

    python .github/smoke/smoke.py config BACKEND --out smoke.toml [--base run.toml]
    python .github/smoke/smoke.py wait --config smoke.toml [--replicas 2] [--timeout 2700]

``config`` writes the smoke run.toml: the base run (``--base``, a project's run.toml; without
it diloco-anywhere's embedded demo run) with the smoke override below, and only BACKEND's
``[backends.*]`` table. The environment can change it, all of it from repository variables:
``SMOKE_STORE`` (the store URL), ``SMOKE_IMAGE`` (the image) and ``SMOKE_<BACKEND>`` (a JSON
object merged into the backend's table, e.g. ``{"role_arn": "...", "image": "..."}`` for
SageMaker).

``wait`` polls ``diloco status --json`` (progress from the bucket, job state from the platform)
until every replica is ``done`` (exit 0), one has failed, stopped or exited without finishing
(exit 1), or the time is up (exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

import tomli_w

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPLICAS = 2
ROUNDS = 2
# What makes any run a smoke run: the tiny model, 2 replicas, 2 outer steps of a few inner
# steps each, a checkpoint after each round (healing has something to load).
OVERRIDE: dict[str, dict[str, Any]] = {
    "run": {"replicas": REPLICAS, "min_replicas": REPLICAS},
    "diloco": {"outer_steps": ROUNDS, "sync_every": 10, "fragments": 1, "fragment_sync_delay": 0},
    "checkpoint": {"every": 1},
    "sync": {"timeout": 900.0},
    "task": {"log_every": 5},
}
TASK_OPTIONS = {"preset": "tiny", "batch_size": 4}
# A backend's table when the base run has none (diloco-anywhere's own smoke run): the
# cheapest hardware that runs the tiny model, on CPU.
CHEAP: dict[str, dict[str, Any]] = {
    "modal": {},
    "hf_jobs": {"flavor": "cpu-basic", "timeout": "1h", "attempts": 1},
    "sagemaker": {"instance_type": "ml.m5.large", "max_runtime_hours": 1},
    "k8s": {"gpus_per_pod": 0, "backoff_limit_per_index": 1},
}
# Each store's credentials in an HF Jobs replica: NAME (the job's secret NAME, read from the
# launcher's NAME) or NAME=SOURCE (read from SOURCE). On S3 the launcher's own AWS_* are its
# OIDC session, which a job outlives: the replicas get the replica user's key, STORE_AWS_*.
STORE_SECRETS = {
    "s3": [
        "AWS_ACCESS_KEY_ID=STORE_AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY=STORE_AWS_SECRET_ACCESS_KEY",
    ],
    "az": ["AZURE_STORAGE_CONNECTION_STRING"],
    "hf": ["HF_TOKEN"],
}
FINISHED_BADLY = {"failed", "stopped", "exited"}
STATUS_FAILURES = 5  # `diloco status` failing this often in a row ends the wait


def smoke_config(backend: str, base: dict[str, Any], environ: dict[str, str]) -> dict[str, Any]:
    """The smoke run.toml (as a dict) for ``backend``, from ``base`` and the environment."""
    if backend not in CHEAP:
        raise SystemExit(f"smoke: no backend {backend!r}; choose from {', '.join(CHEAP)}")
    config = {name: dict(section) for name, section in base.items() if isinstance(section, dict)}
    for name, values in OVERRIDE.items():
        config[name] = {**config.get(name, {}), **values}
    # A smaller model and batch, where the task takes these options (the built-in GPT does;
    # a task of your own keeps its options)
    options = config["task"].get("options", {})
    config["task"]["options"] = {
        **options,
        **{key: value for key, value in TASK_OPTIONS.items() if key in options},
    }
    name = config["run"].get("name", "diloco")
    if name == "demo":  # the embedded run: this repository's own smoke runs
        name = "diloco"
    config["run"]["name"] = f"{name}-smoke-{backend.replace('_', '-')}"
    store = environ.get("SMOKE_STORE") or config["run"].get("store", "")
    if "://" not in store or store.startswith(("file://", "memory://")):
        raise SystemExit(
            f"smoke: the store {store!r} is not one a {backend} replica can reach: set the "
            f"repository variable SMOKE_STORE (e.g. s3://<bucket>/runs)"
        )
    config["run"]["store"] = store
    if environ.get("SMOKE_IMAGE"):
        config["image"] = {"ref": environ["SMOKE_IMAGE"]}
    section = dict(base.get("backends", {}).get(backend) or CHEAP[backend])
    if backend == "hf_jobs" and "secrets" not in section:
        section["secrets"] = STORE_SECRETS.get(store.split("://", 1)[0], [])
    extra = environ.get(f"SMOKE_{backend.upper()}", "").strip()
    if extra:
        try:
            section.update(json.loads(extra))
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            raise SystemExit(
                f"smoke: SMOKE_{backend.upper()} is not a JSON object: {exc}"
            ) from None
    section["replicas"] = REPLICAS
    config["backends"] = {backend: section}
    return config


def verdict(rows: list[dict[str, Any]], replicas: int) -> str | None:
    """``"done"`` when every replica finished its outer steps, ``"failed: ..."`` when one
    cannot any more, None while the run goes on."""
    bad = [f"{row['replica']} {row['state']}" for row in rows if row["state"] in FINISHED_BADLY]
    if bad:
        return f"failed: {', '.join(bad)}"
    done = [row for row in rows if row["state"] == "done"]
    if len(rows) >= replicas and len(done) == len(rows):
        return "done"
    return None


def status(config: Path) -> list[dict[str, Any]] | None:
    """``diloco status --json`` rows, or None (the reason printed) when it failed."""
    beside = Path(sys.executable).parent / "diloco"  # the CLI of this Python's environment
    diloco = str(beside) if beside.exists() else "diloco"
    result = subprocess.run(
        [diloco, "status", "--config", str(config), "--json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        print(result.stderr.strip(), file=sys.stderr, flush=True)
        return None
    return json.loads(result.stdout)


def wait(config: Path, replicas: int, timeout: float, interval: float) -> int:
    deadline = time.monotonic() + timeout
    failures = 0
    while True:
        rows = status(config)
        failures = failures + 1 if rows is None else 0
        if failures >= STATUS_FAILURES:  # credentials or the store, not a passing hiccup
            print(f"::error::smoke: `diloco status` failed {failures} times in a row", flush=True)
            return 1
        rows = rows or []
        shown = ", ".join(f"{r['replica']}={r['state']}@{r['outer_step']}" for r in rows)
        print(f"[{time.strftime('%H:%M:%S')}] {shown or 'no replica reporting yet'}", flush=True)
        outcome = verdict(rows, replicas)
        if outcome == "done":
            print(f"smoke: all {len(rows)} replicas done ({ROUNDS} outer steps)")
            return 0
        if outcome:
            print(f"::error::smoke: {outcome}", flush=True)
            return 1
        if time.monotonic() > deadline:
            print(f"::error::smoke: not done after {timeout:.0f} s: {shown}", flush=True)
            return 1
        time.sleep(interval)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("config", help="write the smoke run.toml")
    make.add_argument("backend", choices=sorted(CHEAP))
    make.add_argument("--out", type=Path, required=True)
    make.add_argument("--base", type=Path, help="the run.toml to start from")
    poll = commands.add_parser("wait", help="wait until every replica is done")
    poll.add_argument("--config", type=Path, required=True)
    poll.add_argument("--replicas", type=int, default=REPLICAS)
    poll.add_argument("--timeout", type=float, default=2700.0)
    poll.add_argument("--interval", type=float, default=30.0)
    arguments = parser.parse_args(argv)
    if arguments.command == "wait":
        return wait(arguments.config, arguments.replicas, arguments.timeout, arguments.interval)
    if arguments.base:
        base = tomllib.loads(arguments.base.read_text())
    else:
        text = resources.files("diloco_anywhere").joinpath("default_run.toml").read_text()
        base = tomllib.loads(text)
    config = smoke_config(arguments.backend, base, dict(os.environ))
    arguments.out.write_text(tomli_w.dumps(config))
    print(f"smoke: wrote {arguments.out} (run {config['run']['name']} on {arguments.backend})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
