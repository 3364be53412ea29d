"""One check in a process of its own: ``python -m diloco_anywhere.bench.gpu.one TARGET DEVICE
WORK RESULT``, TARGET the check's ``module:function`` (``plan.CHECKS``); its outcome as JSON in
RESULT. The runner (``runner.py``) starts it under the
check's time limit; a crash or a refusal of the device is an outcome too (FAIL with its
reason), so the next check still runs."""

from __future__ import annotations

import json
import logging
import sys
import traceback
from pathlib import Path

import torch

from diloco_anywhere.bench.gpu.outcome import Outcome, skipped
from diloco_anywhere.bench.gpu.plan import SIZES
from diloco_anywhere.task import load_entrypoint


def run_check(target: str, device: torch.device, work: Path) -> Outcome:
    if device.type == "cuda" and not torch.cuda.is_available():
        return skipped("no CUDA device here (torch.cuda.is_available() is False)")
    try:
        return load_entrypoint(target)(device, SIZES[device.type], work)
    except Exception as exc:
        traceback.print_exc()
        return Outcome("FAIL", reason=f"{type(exc).__name__}: {exc}"[-3000:])


def main(argv: list[str]) -> int:
    target, device, work, result = argv
    Path(work).mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    outcome = run_check(target, torch.device(device), Path(work))
    Path(result).write_text(json.dumps(outcome.as_dict(), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
