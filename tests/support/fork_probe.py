"""What a process forked by ``replica_forks`` sees, written as JSON to the file its first
argument names; it then exits with its second argument's code, or SIGKILLs itself ("kill"),
or sleeps ("sleep")."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

import torch

if __name__ == "__main__":
    report, ending = sys.argv[1], sys.argv[2]
    with open(report, "w") as file:
        json.dump({
            "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
            "probe": os.environ.get("PROBE"), "session_leader": os.getsid(0) == os.getpid(),
            "stdin": os.read(0, 10).decode(), "random": random.random(),
            "torch": torch.rand(1).item(), "main": __name__,
        }, file)  # fmt: skip
    print(f"probe {ending}", flush=True)
    if ending == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if ending == "sleep":
        time.sleep(600)
    sys.exit(int(ending))
