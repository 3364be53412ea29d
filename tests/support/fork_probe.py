"""What a process forked by ``replica_forks`` sees, written as JSON to the file its first
argument names, with the modules its first training step imported that the server had not
(what every replica would import again); it then exits with its second argument's code, or
SIGKILLs itself ("kill"), or sleeps ("sleep")."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

import torch


def imported_by_a_first_step() -> list[str]:
    """The modules a model's first AdamW step imports, as a replica's first inner step does."""
    before = set(sys.modules)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return sorted(set(sys.modules) - before)


if __name__ == "__main__":
    report, ending = sys.argv[1], sys.argv[2]
    first_step = imported_by_a_first_step()
    with open(report, "w") as file:
        json.dump({
            "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
            "probe": os.environ.get("PROBE"), "session_leader": os.getsid(0) == os.getpid(),
            "stdin": os.read(0, 10).decode(), "random": random.random(),
            "torch": torch.rand(1).item(), "main": __name__, "first_step": first_step,
        }, file)  # fmt: skip
    print(f"probe {ending}", flush=True)
    if ending == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if ending == "sleep":
        time.sleep(600)
    sys.exit(int(ending))
