"""``diloco bench gpu`` (``make gpu-check``): the paths only a GPU takes, checked in one command.

A GPU machine is lent to a few issues, for minutes: the checks are ready before it is
(../shared/GPU-CHECKS.md). Each runs in a fresh process of its own under a time limit
(``runner.py``), on the sizes of its device (``plan.py``), and ends PASS, FAIL or SKIP with
its numbers: a real replica pair on the device (``replica_run.py``), the codecs on device
tensors (``device_codecs.py``), a sync's host memory from GPU tensors (``device_sync.py``),
FSDP2 on NCCL against the CPU (``fsdp_agreement.py``) and the compiled built-in loop
(``compiled_loop.py``). ``--device cpu`` runs them all at tiny sizes, inside ``make test``.
"""
