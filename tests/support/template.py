"""The copier template rendered with copier's own API, as ``copier copy`` would."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import copier
import tomllib
import yaml

from support import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ACCOUNT = {"aws_account_id": "123456789012"}  # asked only with sagemaker


BACKENDS = ("modal", "hf_jobs", "sagemaker", "k8s")


def render(tmp_path: Path, **answers) -> Path:
    """The template rendered non-interactively with ``answers`` over the defaults."""
    destination = tmp_path / "project"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a template repo with uncommitted changes warns
        copier.run_copy(
            str(ROOT), destination, data=answers, defaults=True, quiet=True, vcs_ref="HEAD"
        )
    return destination


def rendered_files(project: Path) -> list[Path]:
    return sorted(p for p in project.rglob("*") if p.is_file())


def answers_of(project: Path) -> dict:
    return yaml.safe_load((project / ".copier-answers.yml").read_text())


PARSERS = {".toml": tomllib.loads, ".yml": yaml.safe_load, ".yaml": yaml.safe_load,
           ".json": json.loads}  # fmt: skip


def assert_clean(project: Path) -> None:
    """Every file rendered: no Jinja markup left, no .jinja suffix, every TOML, YAML and JSON
    file parses, and ruff passes on the project with the project's own settings."""
    for path in rendered_files(project):
        text = path.read_text()
        assert path.suffix != ".jinja", path
        assert "{{" not in text.replace("${{", ""), path  # GitHub Actions' ${{ }} stays
        assert "{%" not in text, path
        if path.suffix in PARSERS:
            PARSERS[path.suffix](text)
    ruff = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "."],
        cwd=project, capture_output=True, text=True,
    )  # fmt: skip
    assert ruff.returncode == 0, ruff.stdout[-2000:]
