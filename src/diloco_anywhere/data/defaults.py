"""How a corpus is prepared unless told otherwise (``diloco data prepare``'s defaults, and a raw
corpus's run copy, ``prepare_once.py``). Its own module, free of numpy and the tokenizers, so
that the CLI shows them in ``--help`` without loading either."""

SHARD_TOKENS = 1 << 26  # 128 MiB of uint16: one object, one put
BLOCK_TOKENS = 1 << 16  # what a reader checks at once: far more than a sequence
HELDOUT_FRACTION = 0.01
