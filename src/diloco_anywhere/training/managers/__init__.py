"""The drop-ins for ``torchft.Manager`` that torchft's ``DiLoCo`` syncs through: interchangeable
implementations of one interface, picked per process by ``group.make_manager``.

- ``bucket.py``: ``BucketManager``, one process's syncs as bucket rounds (the public drop-in
  for scripts that build torchft's ``DiLoCo`` themselves: docs/api.md);
- ``group.py``: the leader and followers of a replica of several DDP processes (``torchrun``);
- ``sharded.py``: a rank of a sharded (FSDP2) replica, syncing its own shard.
"""
