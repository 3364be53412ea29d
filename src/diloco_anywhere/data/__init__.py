"""The training data as a layer of its own: corpora tokenized once into checked token shards in
a store (``prepare.py``), described by a manifest (``manifest.py``), and the shards' own format
(``shards.py``); where documents come from (``documents.py``) and which are held out
(``heldout.py``); the tokenizers (``tokenizers.py``)."""
