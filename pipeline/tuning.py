"""The fixed numbers of voxmill's loops: how often each looks again, and how much it asks at once.

They change latency or load, never an outcome (a missed announcement is found at the next look),
so they are not settings; the ones an operator may need to change are (`pipeline.settings`).
"""

# Worker processes (`workers.reload.coordinator`)
HEARTBEAT_MIN_GAP_S = 0.25  # finished tasks are shown this soon; more tasks in between share one write
SLOT_RETRY_S = 0.1  # a reload round waiting for a slot or a verdict comes again this soon
PEERS_TTL_S = 10.0  # the machine's live processes are counted again after this long

# The watcher (`workers.reload.watcher`, `workers.reload.validation`)
WATCH_TICK_S = 0.1  # events are drained and the folder's symlink followed this often
WATCH_RESCAN_S = 2.0  # every role's file is looked at this often, whatever the events said
VALIDATOR_EXIT_GRACE_S = 10.0  # a validator that gave its verdict has this long to exit

# Producers (`workers.queue.client`, `workers.queue.wakeups`)
RESULT_POLL_S = 0.25  # every pending result is read at least this often, announced or not
RESULT_READ_BATCH = 500  # results read per MGET
SUBSCRIBE_BATCH = 1000  # result channels subscribed per command

# The corpus driver (`pipeline.run.driver`)
SHARD_LOOK_S = 1.0  # the files of the shards in flight are looked for at least this often
WINDOW_REFRESH_S = 2.0  # the number of ready workers (the window of shards in flight) is read this often
MAX_DEADLINE_DOUBLINGS = 8  # a shard or job sent again and again waits at most 8x the deadline
RECENT_SHARDS = 200  # the deadline follows the median time of this many recent shards
CONSUMERS_LOOK_S = 2.0  # a run on a broker looks for the live consumers of its queues this often

# Producers' redelivery and consumer checks (`workers.queue.client`, `workers.queue.delivery`)
CONSUMERS_TTL_S = 1.0  # the live workers' records are read again after this long (submit checks)
CONSUMER_CONFIRM_MARGIN_S = 1.0  # a queue is without consumer after a heartbeat interval plus this
LOOK_S = 1.0  # pending jobs older than this are looked at (model errors, lost jobs) this often
QUEUE_SCAN_BATCH = 500  # queued messages read per LRANGE when looking for late jobs in their queue
QUEUE_SCAN_MAX = 20_000  # a queue is read this far from its oldest end; a job not found is taken as queued
RECENT_JOBS = 200  # a producer's deadline follows the median latency of this many recent jobs
REASONS_SHOWN = 3  # workers named in an error that says why none can serve a job
