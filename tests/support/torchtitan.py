"""torchtitan's environment for the tests: torchtitan 0.3.0's ``datasets`` caps fsspec below
the version the project's environment pins, so it lives in an environment of its own, as a
user's ``pip install 'diloco-anywhere[torchtitan]'`` makes it: ``.tools/torchtitan`` (``make
test`` builds it)."""

from __future__ import annotations

import pytest

from support import ROOT

TORCHTITAN_PYTHON = ROOT / ".tools" / "torchtitan" / "bin" / "python"
needs_torchtitan = pytest.mark.skipif(
    not TORCHTITAN_PYTHON.exists(),
    reason="torchtitan's environment is missing: make .tools/torchtitan (make test does)",
)
# What the template's torchtitan projects ship for the debug job: a byte-level tokenizer and
# torchtitan's llama3 debug model as transformers' LlamaConfig (config.json)
DEBUG_ASSETS = ROOT / "template" / "src" / "{{ package_name }}"
DEBUG_ASSETS /= "{% if task == 'torchtitan' %}assets{% endif %}/bytes"
