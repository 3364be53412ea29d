"""A parameter's name as the run stores and compares it: without the prefix ``torch.compile``'s
wrapper puts before every name (``_orig_mod.``), so a compiled model and the same model
uncompiled are one model to the run's initial state, to ``init_from`` and to an export.
"""

from __future__ import annotations

COMPILED_PREFIX = "_orig_mod."


def parameter_name(name: str) -> str:
    return name.replace(COMPILED_PREFIX, "")
