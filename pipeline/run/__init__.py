"""A corpus run, once its workers can be reached: lock the output folder, plan the listing, drive
the shards to their files, merge; the workers are a port (`pipeline.run.shard_queue.ShardQueue`)."""
