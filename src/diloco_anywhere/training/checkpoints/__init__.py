"""Global checkpoints in the bucket: the run's global state after a round, never pickled
(docs/checkpoints.md).

One concern per module, where there was one file of a thousand lines; each imports only the
ones above it in this list, so none needs the whole:

- ``records``: the COMMIT and PART records, and the data classes the others pass around;
- ``commits``: which rounds are committed, and a COMMIT read and checked (torch-free: the
  keeper reads commits without loading a checkpoint);
- ``tree``: a state tree as path-named tensors plus a JSON structure, and back;
- ``reader``: one committed checkpoint loaded, every byte checked;
- ``catalogue``: which checkpoints exist, and the newest that loads intact;
- ``writer``: writing, committing and pruning them.
- ``replica_states``: one replica's own state (``training/recovery/own_state.py``), written and read
  as a checkpoint is.

Copying a checkpoint to another store lives with the mirrors (``training/recovery/mirrors.py``).
Nothing is re-exported here: import each name from its module.
"""
