"""Every Redis key and channel voxmill uses (Celery's own keys aside)."""

# Celery queues (Redis lists named after them), one per op.
QUEUES = ("tokenize", "embed", "extract")

PREFIX = "voxmill"
# Hash per model role: the published generation (sha256, path, size, generation, time).
GENERATION = PREFIX + ":generation:{role}"
# Counter per role: the last generation number handed out.
GENERATION_COUNTER = PREFIX + ":generation-counter:{role}"
# Pub/sub channel announcing a new generation (message: the role).
GENERATION_CHANNEL = PREFIX + ":generations"
# Hash per role: the last rejected candidate (path, sha256, reason, time).
REJECTION = PREFIX + ":rejection:{role}"
# Hash per worker process, refreshed as a heartbeat and expiring when the process is gone.
WORKER = PREFIX + ":worker:{worker_id}"
WORKER_PATTERN = PREFIX + ":worker:*"
# Sorted set of completion times (score) of recent tasks, for throughput over the last minute.
COMPLETIONS = PREFIX + ":completions"
# Pub/sub channel of one corpus run: a shard task announces each shard it wrote (a ShardResult as
# JSON) to the run's driver. The shard file is the truth; a lost announcement costs a stat.
SHARDS_DONE_CHANNEL = PREFIX + ":run:{run}:shards-done"
# Short-lived locks limiting how many processes of one machine reload a role at the same time.
RELOAD_SLOT = PREFIX + ":reload-slot:{host}:{role}:{slot}"
# The candidate a machine's watcher is validating for a role (JSON: sha256, file, since); expires.
CANDIDATE = PREFIX + ":candidate:{host}:{role}"
CANDIDATE_PATTERN = PREFIX + ":candidate:*:{role}"
# Lock: the one process of a machine standing aside (taking no task) while it reloads.
ASIDE = PREFIX + ":aside:{host}"
# A corpus run's progress as its driver publishes it (JSON; expires soon after the driver stops).
RUN_PROGRESS = PREFIX + ":run:{run}:progress"
RUN_PROGRESS_PATTERN = PREFIX + ":run:*:progress"
# List of the messages workers refused (`workers.queue.admission.DeadLetter` as JSON), newest
# first, capped (`workers.queue.consumer.DEAD_LETTERS_KEPT`).
DEAD_LETTERS = PREFIX + ":dead-letters"
