"""The copier template rendered with copier's own API, as ``copier copy`` would."""

from __future__ import annotations

import warnings
from pathlib import Path

import copier

from support import ROOT

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
