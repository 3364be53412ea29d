"""The project image, built here with podman (``make image-test``; docs/ci.md), started the ways
the platforms start it: its entrypoint, its user, what it leaves out, SageMaker's ``train``,
and replicas launched through the Kubernetes and HF Jobs stand-ins, each in its own container,
training one run against moto's S3 on the host. The rendered project's image the same way."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomli_w
import tomllib

from diloco_anywhere.config import load_config
from diloco_anywhere.launching.start.launch import run_metrics
from diloco_anywhere.standins.containers import ENV_STANDIN_ENGINE
from support import image_engine as engine
from support.runs import K8S, diloco, statuses, write_run

pytestmark = pytest.mark.integration

USAGE = "usage: python -m diloco_anywhere.replica"
UID = "10001"


def in_image(podman, image: str, *args: str, user: str | None = None, **options) -> engine.Ran:
    """``podman run`` of ``image`` with ``args``, as a platform gives them to its ENTRYPOINT;
    ``options``: more ``podman run`` flags (``env={...}``, ``volume=...``)."""
    flags = [] if user is None else ["--user", user]
    for name, value in options.items():
        pairs = value.items() if isinstance(value, dict) else [(None, value)]
        for key, item in pairs:
            flags += [f"--{name}", item if key is None else f"{key}={item}"]
    command = [engine.ENGINE, "run", "--rm", "--network", "host", *flags, image, *args]
    return engine.run(command, env=podman.env, timeout=600)


def said(ran: engine.Ran) -> str:
    return f"exit {ran.code}:\n{ran.output[-3000:]}"


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["--help"], id="options-to-the-entrypoint"),
        pytest.param(["python", "-m", "diloco_anywhere.replica", "--help"], id="hf-jobs-and-modal"),
    ],
)
def test_every_way_in_reaches_the_replica(podman, image, args):
    ran = in_image(podman, image, *args)
    assert ran.code == 0, said(ran)
    assert USAGE in ran.output, said(ran)


def test_the_command_replaces_the_entrypoint_as_pid_1(podman, image):
    """The entrypoint execs, so what it starts is PID 1 and gets the platform's SIGTERM."""
    ran = in_image(podman, image, "python", "-c", "import os; print(os.getpid())")
    assert ran.output.split() == ["1"], said(ran)


def test_no_arguments_start_the_replica_itself(podman, image):
    """``docker run IMAGE``: the replica, which without a run says what it needs."""
    ran = in_image(podman, image)
    assert ran.code != 0, said(ran)
    assert "Traceback" not in ran.output, said(ran)
    assert "DILOCO_" in ran.output or "run.toml" in ran.output, said(ran)


def test_sagemaker_starts_the_replica_with_train(podman, image, tmp_path):
    """SageMaker without a ContainerEntrypoint runs ``IMAGE train`` with its own variables and
    /opt/ml mounted ("Use your own training algorithms", AWS docs)."""
    sagemaker_env = {
        "TRAINING_JOB_NAME": "t-sagemaker-0-20261127",
        "TRAINING_JOB_ARN": "arn:aws:sagemaker:us-east-1:123456789012:training-job/t",
        "AWS_REGION": "us-east-1",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI": "/v2/credentials/standin",
    }
    (tmp_path / "ml/input/config").mkdir(parents=True)
    (tmp_path / "ml/input/config/hyperparameters.json").write_text("{}")
    volume = f"{tmp_path / 'ml'}:/opt/ml"
    ran = in_image(podman, image, "train", "--help", env=sagemaker_env, volume=volume)
    assert ran.code == 0, said(ran)
    assert USAGE in ran.output, said(ran)


def test_the_user_is_not_root_and_home_is_writable(podman, image):
    ran = in_image(podman, image, "sh", "-c", 'id -u; id -g; touch "$HOME/probe" && echo ok')
    assert ran.output.split() == [UID, UID, "ok"], said(ran)
    # a platform that runs images under an arbitrary uid in group 0 (OpenShift, runAsUser)
    ran = in_image(podman, image, "sh", "-c", 'touch "$HOME/probe" && echo ok', user="123456:0")
    assert ran.output.split() == ["ok"], said(ran)


LEFT_BEHIND = ("/src", "/etc/pip.conf", "/run/host-pip", "/tmp/pip-install.log", "/root/.cache")


def test_the_final_image_holds_no_build_tree(podman, image):
    found = "; ".join(f'[ -e {path} ] && echo "left: {path}"' for path in LEFT_BEHIND)
    script = (
        f'{found}; for tool in gcc cc make; do command -v $tool && echo "left: $tool"; done; '
        "python -c 'import diloco_anywhere; print(diloco_anywhere.__file__)'"
    )
    ran = in_image(podman, image, "sh", "-c", script)
    assert "left:" not in ran.output, said(ran)
    assert ran.output.strip().startswith("/opt/venv/lib/python3"), said(ran)
    assert "site-packages/diloco_anywhere/__init__.py" in ran.output, said(ran)


def test_every_extra_the_image_workflow_names_is_installed(podman, image):
    modules = ("s3fs", "gcsfs", "adlfs", "huggingface_hub", "transformers", "pyarrow", "accelerate")
    ran = in_image(podman, image, "python", "-c", f"import {', '.join(modules)}")
    assert ran.code == 0, said(ran)


def launch_in_containers(monkeypatch, podman, config: str, *backends: str):
    """``diloco launch`` whose stand-in platforms start each job in the image it names."""
    monkeypatch.setenv(ENV_STANDIN_ENGINE, engine.ENGINE)
    monkeypatch.setenv("CONTAINERS_CONF", podman.env["CONTAINERS_CONF"])
    return diloco("launch", "--config", config, *(f"--backend={b}" for b in backends))


def committed_fingerprints(config: str) -> set[tuple[str, ...]]:
    metrics = run_metrics(load_config(config)).read().values()
    return {tuple(s.fingerprint for s in m.syncs if s.committed) for m in metrics}


def test_two_replicas_each_in_its_container_train_one_run(
    podman, image, tmp_path, monkeypatch, s3_run, hub, cluster
):
    """HF Jobs gives the replica's command to the ENTRYPOINT, Kubernetes replaces it; each
    reaches the bucket on the host as a cloud job reaches its own, with only the environment
    its platform sets (the run's variables, the store's credentials as secrets)."""
    monkeypatch.chdir(tmp_path)
    config = write_run(tmp_path, s3_run[0], replicas=2, outer_steps=2)
    text = Path(config).read_text().replace("ghcr.io/acme/run:1", image)
    Path(config).write_text(text + K8S)

    result = launch_in_containers(monkeypatch, podman, config, "hf_jobs=1", "k8s=1")

    assert result.exit_code == 0, result.output
    rows = statuses(config)
    assert {(r, row["state"], row["outer_step"]) for r, row in rows.items()} == {
        ("hf_jobs-0", "done", 2),
        ("k8s-0", "done", 2),
    }, result.output
    [rounds] = committed_fingerprints(config)  # one history, the same on both replicas
    assert len(rounds) == 2, rounds
    assert [body["dockerImage"] for body in hub.created()] == [image]


def small_run_of(rendered: Path, store: str, image: str, folder: Path) -> str:
    """The rendered run.toml as a one-replica run of the tiny GPT on ``store``, in ``image``."""
    run = tomllib.loads((rendered / "run.toml").read_text())
    run["run"].update(store=store, replicas=1, min_replicas=1)
    run["diloco"].update(sync_every=5, outer_steps=1)
    run["task"]["options"] = {"preset": "tiny", "batch_size": 4, "corpus_bytes": 300000}
    run["image"]["ref"] = image
    run["backends"]["k8s"].update(replicas=1, gpus_per_pod=0, secret="store")
    path = folder / "run.toml"
    path.write_text(tomli_w.dumps(run))
    return str(path)


def test_the_rendered_projects_image_runs_its_replica(
    podman, rendered, rendered_image, tmp_path, monkeypatch, s3_run, cluster
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(rendered / "src"))  # the launcher reads the project's task
    config = small_run_of(rendered, s3_run[0], rendered_image, tmp_path)

    result = launch_in_containers(monkeypatch, podman, config, "k8s=1")

    assert result.exit_code == 0, result.output
    [(replica, row)] = statuses(config).items()
    assert (replica, row["state"], row["outer_step"]) == ("k8s-0", "done", 1), result.output
