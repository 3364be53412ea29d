"""torchtitan's trainer as a replica (docs/api.md, "torchtitan as a replica"): its models,
parallelisms and job configs, synced through the bucket by torchft's DiLoCo.

- ``__main__.py``: ``python -m diloco_anywhere.training.torchtitan``, torchtitan's own command
  line as run.toml's ``[task] command``;
- ``parsing.py``: a job's config from torchtitan's command line, on the version tested;
- ``job.py``: what the run decides of the job's config (steps, checkpoints, seed);
- ``trainer.py``: ``DilocoTrainer``, torchtitan's ``Trainer`` under ``replica.diloco``;
- ``hf_export.py``: a run's export in Hugging Face's layout, with the job's own converter;
- ``cpu.py``: what torchtitan 0.3.0 needs on a CPU-only torch, pinned to the versions tested.
"""
