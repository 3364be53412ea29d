"""What a replica writes down about its training: metrics in the bucket, the log's windows."""
