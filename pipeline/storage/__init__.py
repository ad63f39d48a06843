"""Where bytes live: URLs, object-store reads, output locations and the path jail."""
