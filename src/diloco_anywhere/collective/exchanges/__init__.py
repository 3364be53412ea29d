"""The exchanges after a SEAL: ``gather`` (every replica reduces every part) and ``sharded``
(each reduces its shards and reads the others'), both through one reduction that decodes and
averages the parts where the replica's tensors live, several shards at a time
(``reduction.py``; docs/collective.md, "Reduce")."""
