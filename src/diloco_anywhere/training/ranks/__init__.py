"""One replica of several processes: DDP ranks behind rank 0, FSDP2 ranks syncing their own
shards."""
