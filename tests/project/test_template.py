"""The copier template (copier.yml + template/), rendered with copier's own API.

Answer sets render run.toml files that diloco-anywhere accepts, ask and write only what the
chosen backends and storage need, and leave no Jinja behind; bad answers are refused with the
validator's message; the hardware choices are the platforms' own.
"""

from __future__ import annotations

import ast
import importlib
import keyword
import os
import subprocess
import sys
import warnings
from importlib import metadata
from pathlib import Path

import copier
import hcl2
import markupsafe
import pytest
import tomllib
import torch
import yaml
from huggingface_hub import JobHardware
from packaging.requirements import Requirement

from diloco_anywhere.backends import modal as modal_backend
from diloco_anywhere.backends import sagemaker as sagemaker_backend
from diloco_anywhere.config import parse_config
from diloco_anywhere.launching.start.launch import plan_launch
from diloco_anywhere.task import TaskContext
from support import ROOT
from support.template import ACCOUNT, BACKENDS, answers_of, assert_clean, render, rendered_files

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from support.hf import TINY_LLAMA

CLOUD = {"s3": "s3", "gcs": "gs", "azure": "az", "hf": "hf"}


@pytest.mark.integration
def test_the_defaults_render_a_local_run(tmp_path) -> None:
    project = render(tmp_path)
    assert_clean(project)
    config = parse_config((project / "run.toml").read_text(), "run.toml")
    assert (config.run.name, config.run.replicas, config.run.store) == (
        "my-diloco-run", 2, ".diloco/my-diloco-run/store",
    )  # fmt: skip
    assert config.task.entrypoint == "my_diloco_run.task:build"
    assert config.task.options == {"preset": "small"}
    assert config.backends == {}
    assert (project / "src" / "my_diloco_run" / "task.py").exists()
    assert ".diloco/" in (project / ".gitignore").read_text().splitlines()  # local stores
    answers = answers_of(project)
    assert answers["storage"] == "local"
    assert not answers.keys() & {"bucket", "region", "modal_gpu"}  # not asked


HF_ANSWERS = {"task": "hf_causal_lm", "hf_model": "org/model", "hf_data": "data.jsonl"}


@pytest.mark.integration
@pytest.mark.parametrize(
    ("answers", "replicas", "outer_lr"),
    [({}, 1, 0.5), ({}, 4, 0.7), ({}, 8, 1.0), (HF_ANSWERS, 1, 0.1), (HF_ANSWERS, 4, 0.2)],
)
def test_the_outer_learning_rate_follows_the_replica_count_and_the_task(
    tmp_path, answers, replicas, outer_lr
) -> None:
    """The best outer learning rate grows with the replicas and is lower for a trained
    model (docs/tuning.md)."""
    project = render(tmp_path, local_replicas=replicas, **answers)
    config = parse_config((project / "run.toml").read_text(), "run.toml")
    assert (config.run.replicas, config.diloco.outer_lr) == (replicas, outer_lr)
    assert (config.diloco.outer_momentum, config.diloco.outer_nesterov) == (0.9, True)


@pytest.mark.integration
@pytest.mark.parametrize(("answers", "outer_lr"), [({}, 2.0), (HF_ANSWERS, 1.0)])
def test_a_sparse_run_gets_sparselocos_outer_step_and_h_10(tmp_path, answers, outer_lr) -> None:
    """The codec question: sparse brings its own outer step (no momentum: the error feedback
    stands in for it), its settings written out, and H 10, where it measured best."""
    project = render(tmp_path, codec="sparse", **answers)
    config = parse_config((project / "run.toml").read_text(), "run.toml")
    diloco = config.diloco
    assert (diloco.codec, diloco.sync_every) == ("sparse", 10)
    assert (diloco.outer_lr, diloco.outer_momentum, diloco.outer_nesterov) == (outer_lr, 0, False)
    assert config.collective_config().codec.k == 328
    assert answers_of(project)["codec"] == "sparse"


@pytest.mark.integration
@pytest.mark.parametrize(
    ("storage", "backends"),
    [
        ("s3", ["modal"]),
        ("s3", ["hf_jobs"]),
        ("s3", ["sagemaker"]),
        ("gcs", ["k8s"]),
        ("s3", list(BACKENDS)),
        ("azure", ["modal", "hf_jobs", "k8s"]),
        ("hf", ["hf_jobs"]),
    ],
)
def test_answer_sets_render_only_what_they_chose(tmp_path, storage, backends) -> None:
    project = render(tmp_path, storage=storage, backends=backends, **ACCOUNT)
    assert_clean(project)
    run_toml = (project / "run.toml").read_text()
    config = parse_config(run_toml, "run.toml")
    bucket = "buckets/my-org/my-diloco-run-diloco" if storage == "hf" else "my-diloco-run-diloco"
    assert config.run.store == f"{CLOUD[storage]}://{bucket}/runs"
    assert sorted(config.backends) == sorted(backends)
    assert config.run.replicas == 2 * len(backends)  # each backend's default: 2 replicas
    # platforms of unlike hardware: rounds paced by time, unless the answers say otherwise
    assert config.diloco.pace == ("time" if len(backends) > 1 else "steps")
    answers = answers_of(project)
    for backend in BACKENDS:
        asked = [key for key in answers if key.startswith(f"{backend}_")]
        assert bool(asked) == (backend in backends), (backend, asked)
    # Terraform of the chosen cloud only, with the answers as its variables
    clouds = {"s3": "aws", "gcs": "gcp"}
    for cloud in ("aws", "gcp"):
        chosen = clouds.get(storage) == cloud
        assert (project / "infra" / cloud / "main.tf").exists() == chosen, cloud
        assert (project / "infra" / f"{cloud}.tfvars").exists() == chosen, cloud
    if storage in clouds:
        variables = hcl2.loads((project / "infra" / f"{clouds[storage]}.tfvars").read_text())
        assert variables["bucket_name"] == '"my-diloco-run-diloco"'
    # every platform's settings are accepted by its launcher, image and all
    plan = plan_launch(config, dict.fromkeys(backends, 1), root=tmp_path)
    assert set(plan.backends) == set(backends)
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    assert len(pyproject["project"]["optional-dependencies"]["launch"]) == len(backends)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("answers", "prepare"),
    [
        ({}, "diloco data prepare 'corpus/*.jsonl.zst' .diloco/my-diloco-run/corpus "
             "--tokenizer bytes"),
        ({"storage": "s3", "prepared_data": "s3://my-bucket/corpora/web", **ACCOUNT},
         "diloco data prepare 'corpus/*.jsonl.zst' s3://my-diloco-run-diloco/corpora/main "
         "--tokenizer bytes"),
        ({**HF_ANSWERS, "prepared_data": "gs://b/c"}, "--tokenizer org/model"),
        (HF_ANSWERS, "diloco data prepare 'data.jsonl' .diloco/my-diloco-run/corpus "
                     "--tokenizer org/model"),
    ],
)  # fmt: skip
def test_the_data_answer_renders_the_run_s_data_and_its_prepare_step(
    tmp_path, answers, prepare
) -> None:
    """A prepared corpus becomes run.toml's [task] data (and the HF task's raw `data` option
    is then not asked for: giving both is refused); the README shows the prepare step."""
    project = render(tmp_path, **answers)
    assert_clean(project)
    config = parse_config((project / "run.toml").read_text(), "run.toml")
    prepared = answers.get("prepared_data", "")
    assert config.task.data == prepared
    assert ("data" in config.task.options) == (bool(answers.get("task")) and not prepared)
    assert prepare in " ".join((project / "README.md").read_text().split())


@pytest.mark.integration
def test_k8s_gpus_become_processes_per_replica(tmp_path) -> None:
    project = render(tmp_path, storage="gcs", backends=["k8s"], k8s_gpus_per_pod=4)
    config = parse_config((project / "run.toml").read_text(), "run.toml")
    assert config.backends["k8s"]["processes_per_replica"] == 4


@pytest.mark.integration
@pytest.mark.parametrize(
    ("answers", "message"),
    [
        ({"project_name": "My Run"}, "project_name My Run is not allowed: 2-54 lowercase"),
        ({"package_name": "2fast"}, "package_name 2fast is not allowed: a lowercase Python"),
        ({"package_name": "diloco_anywhere"}, "which a package of that name would shadow"),
        ({"package_name": "lambda"}, "package_name lambda is not allowed: it is a Python keyword"),
        ({"package_name": "json"}, "the name of a module the runtime imports"),
        ({"package_name": "torch"}, "the name of a module the runtime imports"),
        ({"description": "two\nlines"}, "one line of at most 200 characters, without line"),
        ({"description": "a\ttab"}, "one line of at most 200 characters, without line"),
        ({"storage": "s3", "bucket": "My_Bucket"}, "S3 bucket names here are 3-63 lowercase"),
        ({"storage": "s3", "bucket": "runs.example"}, "no '.': TLS to a dotted bucket"),
        ({"storage": "gcs", "bucket": "runs.example"}, "no '.': dotted names need domain"),
        ({"github_repo": "my repo"}, "github_repo my repo: 1-100 letters"),
        ({"storage": "gcs", "bucket": "google-runs"}, "nor containing google"),
        ({"storage": "azure", "bucket": "runs--x"}, "Azure container names are 3-63"),
        ({"storage": "hf", "bucket": "no-owner"}, "namespace/name"),
        ({"backends": ["modal"]}, "replicas on a platform cannot reach a local folder"),
        ({"storage": "s3", "backends": ["hf_jobs"], "hf_jobs_flavor": "h100"}, "h100"),
        ({"storage": "s3", "backends": ["modal"], "modal_gpu": "V100"}, "V100"),
        ({"storage": "s3", "backends": ["k8s"], "k8s_gpus_per_pod": 9}, "0 to 8"),
        ({"storage": "gcs", "backends": ["sagemaker"], **ACCOUNT}, "choose s3 storage"),
        ({"storage": "s3", "backends": ["sagemaker"], "aws_account_id": "12345"}, "12 digits"),
        ({"registry": "https://ghcr.io/x/y"}, "without a scheme"),
    ],
)
def test_bad_answers_are_refused_saying_what_is_allowed(tmp_path, answers, message) -> None:
    with pytest.raises(ValueError, match=message):
        render(tmp_path, **answers)
    assert not (tmp_path / "project" / "run.toml").exists()


def test_hf_jobs_flavors_are_the_hubs_gpu_flavors() -> None:
    """The template offers the flavors huggingface_hub knows (its JobHardware enum, kept in
    sync with the Hub API), GPU ones only."""
    questions = yaml.safe_load((ROOT / "copier.yml").read_text())
    offered = set(questions["hf_jobs_flavor"]["choices"])
    hub = {flavor.value for flavor in JobHardware if not flavor.value.startswith("cpu")}
    assert offered <= hub, offered - hub
    assert "h100" not in offered


def test_modal_gpus_and_sagemaker_instances_are_what_the_launchers_accept() -> None:
    """The template's hardware choices pass the launchers' own checks (Modal's GPU names,
    botocore's list of SageMaker training instance types)."""
    questions = yaml.safe_load((ROOT / "copier.yml").read_text())
    assert set(questions["modal_gpu"]["choices"]) <= set(modal_backend.GPU_NAMES)
    offered = set(questions["sagemaker_instance_type"]["choices"])
    assert offered <= set(sagemaker_backend.instance_types())


@pytest.mark.integration
def test_the_project_carries_the_runtime_this_repository_tests(tmp_path) -> None:
    """Copied through symlinks: the rendered package is this repository's, file for file, and
    its dependencies are this repository's list; the chosen store's SDK is an extra."""
    project = render(tmp_path, storage="gcs", backends=["k8s"])
    runtime = ROOT / "src" / "diloco_anywhere"
    ours = {p.relative_to(runtime) for p in runtime.rglob("*.py")}
    theirs = {p.relative_to(project / "src" / "diloco_anywhere")
              for p in (project / "src" / "diloco_anywhere").rglob("*.py")}  # fmt: skip
    assert theirs == ours
    for relative in ours:
        assert (runtime / relative).read_bytes() == (
            project / "src" / "diloco_anywhere" / relative
        ).read_bytes()
    assert not list(project.rglob("__pycache__"))
    assert (project / "requirements-runtime.txt").read_text() == (
        ROOT / "requirements-runtime.txt"
    ).read_text()
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    assert pyproject["project"]["name"] == "my-diloco-run"
    assert pyproject["project"]["optional-dependencies"]["store"] == ["gcsfs>=2025.3.0"]
    ours_gcs = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert ours_gcs["optional-dependencies"]["gcs"] == ["gcsfs>=2025.3.0"]
    assert (project / "src" / "my_diloco_run" / "task.py").exists()


@pytest.mark.integration
def test_the_rendered_projects_own_tests_pass(tmp_path) -> None:
    """The project's tests, run by pytest from its folder, with its src first on the path
    (as installing it would put it): the replicas import its task package."""
    project = render(tmp_path, storage="s3", backends=["modal", "k8s"], model_preset="tiny")
    environment = {**os.environ, "PYTHONPATH": str(project / "src")}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=project, env=environment, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    # 3 of its own, and a launch request for each of its 2 platforms
    assert "5 passed" in result.stdout


GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "template test", "GIT_AUTHOR_EMAIL": "test@example.com",
    "GIT_COMMITTER_NAME": "template test", "GIT_COMMITTER_EMAIL": "test@example.com",
}  # fmt: skip


def git(cwd: Path, *args: str) -> None:
    subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, env={**os.environ, **GIT_IDENTITY}
    )


@pytest.mark.integration
def test_copier_update_keeps_the_users_edit_and_brings_the_template_change(tmp_path) -> None:
    """v0.1.0 of the template renders a project; its user edits the task; the template changes
    and is tagged v0.2.0; ``copier update`` merges both, with no conflict left."""
    template = tmp_path / "template-repo"
    git(tmp_path, "clone", "-q", str(ROOT), str(template))  # this repository's committed HEAD
    git(template, "tag", "v0.1.0")
    project = tmp_path / "project"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        copier.run_copy(str(template), project, defaults=True, quiet=True, vcs_ref="v0.1.0")
    git(project, "init", "-q")
    git(project, "add", "-A")
    git(project, "commit", "-qm", "rendered from v0.1.0")
    task = project / "src" / "my_diloco_run" / "task.py"
    task.write_text(task.read_text() + "\nUSER_EDIT = True\n")
    git(project, "commit", "-qam", "the user's edit")
    readme = template / "template" / "README.md.jinja"
    readme.write_text(readme.read_text() + "\n## New in v0.2.0\n")
    git(template, "commit", "-qam", "a template change")
    git(template, "tag", "v0.2.0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        copier.run_update(project, defaults=True, overwrite=True, quiet=True, vcs_ref="v0.2.0")
    assert "USER_EDIT = True" in task.read_text()
    assert "## New in v0.2.0" in (project / "README.md").read_text()
    assert answers_of(project)["_commit"] == "v0.2.0"
    for path in rendered_files(project):
        if ".git" not in path.relative_to(project).parts:
            assert "<<<<<<<" not in path.read_text(errors="replace"), path


@pytest.mark.integration
@pytest.mark.parametrize(
    "description",
    ['He said "go" \\ then left', 'a """docstring""" and a \'quote\'', "<b>bold</b> & [link](x)",
     "\u00dcn\u00efc\u00f6d\u00e9 \u2013 dashes"],
)  # fmt: skip
def test_a_description_is_escaped_for_every_file_it_reaches(tmp_path, description) -> None:
    project = render(tmp_path, description=description)
    assert_clean(project)
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    assert pyproject["project"]["description"] == description
    package = project / "src" / "my_diloco_run" / "__init__.py"
    assert ast.get_docstring(ast.parse(package.read_text())) == description
    assert str(markupsafe.escape(description)) in (project / "README.md").read_text()


def _reserved_names() -> set[str]:
    """Keywords, the standard library, and the top-level modules of the runtime's direct
    dependencies as installed here: what a run project's package would shadow."""
    names = set(keyword.kwlist) | set(sys.stdlib_module_names) | {"diloco_anywhere"}
    for line in metadata.distribution("diloco-anywhere").requires or []:
        requirement = Requirement(line)
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue  # an extra, or another Python's
        for file in metadata.distribution(requirement.name).files or []:
            first = file.parts[0]
            if len(file.parts) == 1:
                first = first.removesuffix(".py") if first.endswith(".py") else ""
            if not first.endswith((".dist-info", ".egg-info", ".data")):
                names.add(first)
    return {n for n in names if n.isidentifier() and n == n.lower() and not n.startswith("_")}


def test_the_reserved_package_names_cover_what_the_runtime_imports() -> None:
    listed = set(
        yaml.safe_load((ROOT / "copier.yml").read_text())["reserved_package_names"]["default"]
    )
    assert _reserved_names() - listed == set()


@pytest.mark.integration
def test_the_hf_task_answers_render_a_task_that_builds_with_their_model_and_text(
    tmp_path, hf_corpus
) -> None:
    """A local model folder (a tiny Llama saved here) and a local jsonl, as a user answers."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer_folder, data = hf_corpus
    model_folder = tmp_path / "model"
    # positions for the template's seq_len (512): the task refuses a model with fewer
    config = AutoConfig.for_model(
        **{**TINY_LLAMA, "vocab_size": 120, "max_position_embeddings": 512}
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(model_folder)
    AutoTokenizer.from_pretrained(tokenizer_folder).save_pretrained(model_folder)
    project = render(tmp_path, task="hf_causal_lm", hf_model=str(model_folder), hf_data=str(data))
    assert_clean(project)
    assert "model_preset" not in answers_of(project)
    run = parse_config((project / "run.toml").read_text(), "run.toml")
    assert (run.task.options["model"], run.task.options["data"]) == (str(model_folder), str(data))
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    task_extra = pyproject["project"]["optional-dependencies"]["task"]
    assert any(requirement.startswith("transformers") for requirement in task_extra)
    sys.path.insert(0, str(project / "src"))
    try:
        task_module = importlib.import_module("my_diloco_run.task")
        context = TaskContext(0, 2, 0, torch.device("cpu"), run.task.options, total_steps=100)
        task = task_module.build(context)
    finally:
        sys.path.remove(str(project / "src"))
        sys.modules.pop("my_diloco_run.task", None)
        sys.modules.pop("my_diloco_run", None)
    assert task.micro_batches
    assert task.tokens_per_batch == 8 * 512
