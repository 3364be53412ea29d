"""The template's torchtitan task: the project it renders trains torchtitan's own ``Trainer``
as every replica, on a job of ``src/<package>/jobs.py`` (its debug model on bytes, or Llama
3.1 8B), and its own tests pass where torchtitan is installed (torchtitan's environment,
``support/torchtitan.py``). The suite's torchtitan run trains on the debug job's assets."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from diloco_anywhere.config import parse_config
from support.template import answers_of, assert_clean, render
from support.torchtitan import DEBUG_ASSETS, TORCHTITAN_PYTHON, needs_torchtitan

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

TORCHTITAN_TASK = {"task": "torchtitan"}


def run_project_tests(project, *selection: str) -> subprocess.CompletedProcess:
    """The project's own tests in torchtitan's environment, its src first on the path (as
    installing it would put it): the replicas import its jobs module."""
    return subprocess.run(
        [TORCHTITAN_PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection, "tests"],
        cwd=project, env={**os.environ, "PYTHONPATH": str(project / "src")},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.integration
def test_the_torchtitan_task_renders_its_jobs_module_and_a_run_of_its_debug_job(tmp_path):
    project = render(tmp_path, **TORCHTITAN_TASK)
    assert_clean(project)
    config = parse_config((project / "run.toml").read_text(), "run.toml")
    assert config.task.command == [
        "python", "-m", "diloco_anywhere.training.torchtitan",
        "--module", "my_diloco_run.jobs", "--config", "debug",
    ]  # fmt: skip
    assert config.task.data == "stdlib"  # raw text every machine has: no download
    assert config.run.sharding == "fsdp"  # torchtitan shards a replica of several GPUs
    package = project / "src" / "my_diloco_run"
    assert (package / "jobs.py").exists()
    assert not (package / "task.py").exists()  # the command is the replica: no task module
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["task"] == ["torchtitan==0.3.0"]
    assets = pyproject["tool"]["setuptools"]["package-data"]["my_diloco_run"]
    assert assets == ["assets/**/*"]  # installed with the package, so the image holds them
    assert answers_of(project)["titan_model"] == "debug"
    readme = (project / "README.md").read_text()
    assert "--module my_diloco_run.jobs --config debug" in readme  # its hf_export


def test_the_debug_job_s_tokenizer_is_bytes_and_its_config_the_debug_model_s():
    """Token id b is byte b, whatever the text (no unknown token, no merge), with an end of
    sequence after the bytes; the model's config.json is the one the torchtitan run's
    Hugging Face export loads (``tests/training/test_torchtitan.py``)."""
    tokenizer = AutoTokenizer.from_pretrained(DEBUG_ASSETS)
    text = "déf f(x):\n\treturn '日本' + x  # \x00\xff"
    assert tokenizer(text)["input_ids"] == list(text.encode())
    assert tokenizer.decode(list(text.encode())) == text
    assert (len(tokenizer), tokenizer.eos_token_id) == (258, 257)
    config = (DEBUG_ASSETS / "config.json").read_text()
    assert '"vocab_size": 2048' in config  # torchtitan's debug model: room for 258 ids


@pytest.mark.integration
@needs_torchtitan
def test_the_torchtitan_project_s_own_tests_pass_where_torchtitan_is_installed(tmp_path):
    """Its job parses as a replica's, with its tokenizer in the package: the tests of its own
    that are the torchtitan task's. Its smoke run (two local replicas of the debug job) and
    its launch requests are the other tasks' (``test_template.py``) with torchtitan's launch,
    which the suite's torchtitan run trains on these assets
    (``tests/training/test_torchtitan.py``): not run twice."""
    project = render(tmp_path, **TORCHTITAN_TASK)
    result = run_project_tests(project, "-k", "job")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "2 passed, 3 deselected" in result.stdout  # the job, its tokenizer


@pytest.mark.integration
def test_the_llama3_8b_project_names_its_job_and_says_where_its_gated_tokenizer_goes(tmp_path):
    """Its run.toml trains the 8B job on text of the Hub; its tokenizer is not in the
    template (Meta's repository is gated), and its README says how to download it into the
    package, where the job reads it and the project's own test looks for it."""
    project = render(
        tmp_path, **TORCHTITAN_TASK, titan_model="llama3_8b", storage="s3", backends=["modal"]
    )
    assert_clean(project)
    config = parse_config((project / "run.toml").read_text(), "run.toml")
    assert config.task.command[-2:] == ["--config", "llama3_8b"]
    assert config.task.data.startswith("hf://datasets/")
    readme = " ".join((project / "README.md").read_text().split())
    assert (
        'hf download meta-llama/Llama-3.1-8B --include "tokenizer*" "*config.json" \\ '
        "--local-dir src/my_diloco_run/assets/Llama-3.1-8B"
    ) in readme
    jobs = (project / "src" / "my_diloco_run" / "jobs.py").read_text()
    assert 'config.hf_assets_path = str(ASSETS / "Llama-3.1-8B")' in jobs
    assert not (project / "src" / "my_diloco_run" / "assets" / "Llama-3.1-8B").exists()
