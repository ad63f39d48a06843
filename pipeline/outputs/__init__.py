"""What a run writes: shard files, the merged outputs, their export and their audit."""
