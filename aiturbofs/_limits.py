"""Every bound of aiturbofs in one place.

Units come last in names (``chunk_bytes``, ``persist_retry_window_s``).  Code
elsewhere must not hard-code sizes, counts or timeouts: it imports them from
here so a reader can see every limit of the system on one screen.
"""

import os

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

# --- checks -------------------------------------------------------------------
# AITURBOFS_CHECK_INVARIANTS=1 (the tests set it): the staging pool hashes every chunk it hands
# out of a backing file's range, not only those the kernel may be writing, and a sealed range
# whose bytes changed is an AssertionError (the request fails with EIO, the log says "BUG").
CHECK_INVARIANTS = os.environ.get("AITURBOFS_CHECK_INVARIANTS", "") not in ("", "0")

# --- chunks -----------------------------------------------------------------
CHUNK_BITS = 23
CHUNK_BYTES = 1 << CHUNK_BITS  # 8 MiB: the unit of hashing, staging, upload
HASH_BYTES = 32  # BLAKE3 digest length
SMALL_BUFFER_BYTES = 256 * KiB  # first buffer of a chunk that starts small
HASH_INLINE_BYTES_MAX = 1 * MiB  # hash smaller chunks on the trio thread
ZERO_SAMPLE_STRIDE_BYTES = 4 * KiB  # a sealed chunk is checked for all zeros (a hole) only if every byte at this stride is 0
ZERO_DIGESTS_CACHED = 64  # BLAKE3 digests of all-zero chunks, by length (full chunks and recent tail lengths)
ZERO_BLOCK_BYTES = 1 * MiB  # zeros are hashed, and written where a hole cannot be punched, in pieces of this
ZERO_RUN_BYTES = 64 * KiB  # local backend: aligned runs of zeros this long inside a data part are left as holes

# --- FUSE ---------------------------------------------------------------------
FUSE_REQUEST_BYTES_MAX = 1 * MiB  # libfuse 3.14 fixes max_write at 256 pages
# FUSE requests handled at once (pyfuse3's default is 99).  Writers waiting
# for pool memory each hold one: at 99 of them every other request (a stat,
# the close that would free memory) waited.  A task costs its request
# (<= FUSE_REQUEST_BYTES_MAX, held by the waiting writer anyway).
FUSE_TASKS_MAX = 1024
# st_blksize: cp, dd and stdio size their I/O by it, so each request is one
# full FUSE write.  fsstress's copy_file_range/splice place copies up to 1024
# blocks past EOF (1 GiB): a hole, which costs nothing (see docs/design.md).
ST_BLKSIZE_BYTES = FUSE_REQUEST_BYTES_MAX
NAME_BYTES_MAX = 255  # like ext4 / NAME_MAX
PATH_BYTES_MAX = 4096  # like PATH_MAX
S3_KEY_BYTES_MAX = 1024  # S3's limit on an object key
SYMLINK_TARGET_BYTES_MAX = 4095
XATTR_NAME_BYTES_MAX = 255
XATTR_VALUE_BYTES_MAX = 64 * KiB
XATTRS_PER_INODE_MAX = 1024
READ_AHEAD_KB = 1024  # set on the mount's bdi: doubles sequential reads
SESSION_END_GRACE_S = 5.0  # at unmount/SIGTERM, running FUSE requests get this long before they are cancelled
UNMOUNT_POLL_S = 1.0  # how often the daemon looks for its mount in the mount table (lazy unmounts)
PASSTHROUGH_FREE_FRACTION_MIN = 0.25  # a new file goes to the kernel (passthrough) only while this much of the pool is free
KERNEL_CHARGE_POLL_S = 0.1  # how often the bytes the kernel wrote into open files are counted against the pool
ATTR_TIMEOUT_S = 1.0  # kernel attribute / entry cache lifetime
FILE_SIZE_BYTES_MAX = 16 * TiB  # like ext4 with 4 KiB blocks

# --- staging pool ---------------------------------------------------------------
POOL_DEFAULT_RAM_FRACTION = 0.25  # default -o dram: a quarter of total RAM
POOL_BYTES_MIN = 2 * CHUNK_BYTES  # below this no file could make progress
FREE_BUFFERS_KEPT_MAX = 64  # recycled full-size buffers kept warm (first-touch is slow)
SPILL_WAIT_S = 2.0  # without -o spill, wait this long for persist before spilling
BACKING_FDS_OPEN_MAX = 256  # backing files kept open (the others are reopened by path)
BACKING_SPARES = 64  # empty backing files made ahead on disk by a thread (a new file's create costs a link)
STAGING_SLACK_BYTES_MIN = 64 * MiB  # the staging tmpfs holds the budget plus an eighth of it, at least this much
SPILL_IN_FLIGHT_MAX = 2  # chunk writes to the spill dir at once

# --- persist --------------------------------------------------------------------
PERSIST_FILES_IN_FLIGHT = 4  # files uploading at once
# Extra uploads started while files in flight only wait for another file's
# durable copy of a chunk (cluster dedup): the file making that copy may be
# queued behind them, and without a spare it waited CLUSTER_SOURCE_WAIT_S.
PERSIST_SPARE_FILES_MAX = 16
PERSIST_PARTS_IN_FLIGHT = 4  # parts of one file uploading at once
PERSIST_RETRY_WINDOW_S = 24 * 3600.0  # default -o persist_retry_window
# While the application writes (a request that changes files came within
# PERSIST_YIELD_QUIET_S) and nobody waits for durability, a closed file's
# persist starts once the writers pause, or PERSIST_YIELD_S after it was
# queued: the persister's per-file work runs on the thread that serves the
# writers' requests, and small files closed 2x faster without it in the way.
PERSIST_YIELD_S = 5.0  # default -o persist_yield (rclone mount uploads 5 s after the last close, --vfs-write-back)
PERSIST_YIELD_QUIET_S = 0.02
PERSIST_YIELD_FREE_MIN = 0.5  # ... and while at least this part of the DRAM budget is free (no wait for memory ahead)
FULL_BACKEND_WAIT_S = 60.0  # default -o full_backend_wait: then writers waiting for memory get ENOSPC
PERSIST_BACKOFF_FIRST_S = 0.2
PERSIST_BACKOFF_MAX_S = 30.0
BACKEND_THREADS_MAX = 8  # blocking backend calls in worker threads at once
LOCAL_SMALL_PART_BYTES = 1 << 20  # file://: a first part up to this is copied and written with the publish (one thread hop)
# A symlink or special file made beside its name lives for one blocking call before its rename: one
# older than this was left by a process that died (upload temps are locked instead: backend/_temps.py).
STALE_NODE_TEMP_S = 600.0
UPLOAD_DIRS_SWEPT_MAX = 65536  # file://: directories whose dead uploads' temps were looked for (a set of paths)
BACKEND_CALL_TIMEOUT_S = 120.0  # one backend call (a part, a listing)
DRAIN_TIMEOUT_S_DEFAULT = 600.0  # default -o drain_timeout at unmount/SIGTERM
BACKEND_CONNECT_TIMEOUT_S = 10.0  # S3 TCP connect: a dead endpoint fails fast, as transient
BACKEND_READ_TIMEOUT_S = 60.0  # S3 socket read; below BACKEND_CALL_TIMEOUT_S so botocore gives up first
BACKEND_COPY_PART_BYTES = 512 * MiB  # whole-object copies done part by part (one backend call each)
S3_PART_BYTES_MIN = 5 * MiB  # S3 rejects smaller parts except the last
S3_PARTS_MAX = 10_000  # S3 multipart limit: with CHUNK_BYTES parts an object is at most ~78 GiB
S3_PART_BYTES_MAX = 5 * GiB  # S3's largest part
S3_OBJECT_BYTES_MAX = 5 * TiB  # S3's largest object
PERSIST_WIDE_PARTS_IN_FLIGHT = 2  # parts of several chunks (files over parts_max chunks) assembled in memory at once, node-wide
S3_COPY_OBJECT_BYTES_MAX = 5 * GiB  # CopyObject limit; larger objects are copied part by part
S3_ZERO_OBJECT_BYTES_MAX = 5 * GiB  # S3's PutObject limit: hole parts copy from one hidden zero object of the part size (larger: sent as zeros)
S3_PUT_BYTES_MAX = 1 * MiB  # a lone short part is copied on the trio thread and sent as one PutObject
UPLOAD_TOKEN_BYTES_MAX = 32 * KiB  # a remote-part token or receipt: a key, escaped, plus an UploadId; fits a fabric control body
PERSIST_BACKOFF_JITTER = 0.5  # a retry sleeps backoff x uniform(1 - this, 1): files failed by one outage do not retry in step
# A read of a chunk from the backend retries transient errors (a 503, a reset
# connection) this many times, backing off from READ_RETRY_FIRST_S (doubling,
# jittered): about 3 s in all before the reader gets EIO.
READ_RETRY_ATTEMPTS = 5
READ_RETRY_FIRST_S = 0.2
PERSIST_PARTS_COPIED_MAX = 4  # parts uploading at once from a copy of their chunk in the heap (a backing-file range's copy, or one read back from spill or the backend): outside the budget
S3_STALE_UPLOADS_MAX = 1024  # multipart uploads whose abort failed, kept to abort again once S3 answers (oldest forgotten)
# A backend that does not answer (refused, or a brownout: connections accepted, no reply)
# is "unavailable": the mount still comes up and serves from the metadata and the pool.
BACKEND_CHECK_TIMEOUT_S = 5.0  # the bucket/root check at mount, and each probe while unavailable
BACKEND_PROBE_FIRST_S = 1.0  # while unavailable, probe after this, doubling (jittered)...
BACKEND_PROBE_MAX_S = 15.0  # ...up to this
READ_BACKEND_TIMEOUT_S = 30.0  # a reader's fetch from the backend, retries included; then EIO

# --- namespace import from the backend ------------------------------------------
IMPORT_TTL_S = 5.0  # default -o import_ttl: re-list a backend directory after this
# An expired directory is re-listed in the background; a lookup waits this long
# for that listing, then answers from the metadata (not at all while the backend
# is unavailable).  A never-imported directory waits for its first listing.
IMPORT_WAIT_S = 1.0
IMPORT_DIRS_REMEMBERED_MAX = 65536  # directories whose last import time is kept in memory (~100 B each)
LIST_ENTRIES_MAX = 1_000_000  # entries imported from one backend directory
# HEADs at once while an import asks whether small new objects are symlinks
# or special files (S3 lists no metadata: see Backend.node_probe_bytes_max).
IMPORT_NODE_PROBES_IN_FLIGHT = 8

# --- metadata ---------------------------------------------------------------------
META_SQLITE_READERS = 2  # sqlite: reader connections (and threads) beside the one writer
META_SQLITE_CHECKPOINT_COMMITS = 500  # sqlite: groups between WAL checkpoints (in a thread)
META_SQLITE_GROUP_MAX = 256  # sqlite: write transactions one group commit (one fsync) runs at most
ERRORS_KEPT_MAX = 100  # recent errors shown by `aiturbo status`
READDIR_BATCH_ENTRIES = 256  # entries one FUSE readdir reads from the metadata engine
IMPORT_READDIR_BATCH_ENTRIES = 1024  # entries an import reads at once to compare with a listing
IMPORT_CREATE_BATCH_ENTRIES = 256  # new entries an import creates in one metadata transaction
RENAME_READDIR_BATCH_ENTRIES = 512  # entries a renamed tree's walk reads at once
DIRS_TO_CLEAN_MAX = 10_000  # removed directories whose backend directory waits to be removed
# A backend directory whose entries the persister changed gets its mtime back
# this long after the first change (file://): a burst of files in it costs one call.
DIR_ATTRS_SETTLE_S = 0.5
DIRS_SETTLING_MAX = 10_000  # directories waiting so; beyond, one is queued at once
SEAL_QUEUE_MAX = 1024  # full chunks waiting for the background sealer
META_BUSY_TIMEOUT_S = 30.0  # sqlite: wait this long for another daemon's write lock
META_READDIR_ENTRIES_MAX = 4096  # entries one readdir call returns at most
META_KEYS_PER_STATEMENT_MAX = 500  # keys in one IN (...) list: under sqlite's 999-parameter floor
META_LOOKUP_PATH_JOINED_MAX = 16  # names lookup_path joins in one statement (sqlite joins <= 64 tables)
LINKS_PER_INODE_MAX = 65000  # hard links to one file, like ext4 (EMLINK beyond)
DIR_DEPTH_MAX = PATH_BYTES_MAX // 2  # a path of one-byte names: bounds walks to the root
META_PG_CONNECTIONS = 4  # postgresql: connections (and worker threads) per store; 4x lookups at 0.5 ms RTT
META_PG_TX_ATTEMPTS_MAX = 20  # postgresql: runs of one transaction that keeps losing serialization conflicts
META_PG_RETRY_BACKOFF_FIRST_S = 0.002  # postgresql: jittered backoff before the 2nd run, doubling...
META_PG_RETRY_BACKOFF_MAX_S = 0.2  # ...up to this
META_PG_CONNECT_TIMEOUT_S = 10  # postgresql: libpq connect_timeout (whole seconds); a call's wait for a connection
META_PG_RECONNECT_S = 10.0  # postgresql: the pool replaces a lost connection in the background this long (1 s doubling), then leaves it to the next call
META_PG_STATEMENT_TIMEOUT_S = 30.0  # postgresql: one statement, lock waits included
META_PG_KEEPALIVE_S = 5  # postgresql: TCP keepalive idle/interval; a silent server is dropped after ~4x this

# --- control socket ---------------------------------------------------------------
CONTROL_REQUEST_BYTES_MAX = 64 * KiB
CONTROL_CLIENTS_MAX = 16
CONTROL_CALL_TIMEOUT_S = 10.0
CONTROL_WAITS_MAX = 64  # "wait" requests asleep at once (each holds one task), apart from the ones above
VERIFY_CHUNKS_PER_CALL = 4  # ``aiturbo verify`` asks the daemon for this many chunks a request (32 MiB: well within the call timeout)
WAIT_POLL_S = 0.2  # `aiturbo wait` refresh period where it reads the state xattr (no control socket)
# aiturbofs.wait() / `aiturbo wait` ask the daemon (control "wait"), which answers when the files settle:
WAIT_SLICE_S = 5.0  # one call waits at most this long; a longer wait asks again (a hung daemon shows)
WAIT_GATHER_S = 0.2  # once a file of a call settled, the answer waits this long for more (progress, not a call per file)
WAIT_INOS_PER_CALL = 1024  # files one call names: ~20 KiB of JSON, within CONTROL_REQUEST_BYTES_MAX
# ... but a call that waits names only the first this many files not settled: the daemon reads each
# at the call's start, and a wait on 2,000 small files that named 1,024 a call took more of the
# daemon's thread than the persister it waited for (the persister goes in order: the first files
# settle first, and the next call takes the next ones).
WAIT_HELD_INOS = 128
assert 2 * WAIT_SLICE_S <= CONTROL_CALL_TIMEOUT_S  # the answer, its reads too, comes well before either end gives up

# --- daemon start
BACKGROUND_NICE = 10  # worker threads doing bulk work yield to the FUSE thread
MALLOC_MMAP_THRESHOLD_BYTES = 4 * MiB  # glibc: 1 MiB request buffers from the heap; 8 MiB chunk buffers still mmap
MALLOC_TRIM_THRESHOLD_BYTES = 128 * MiB  # glibc: keep this much freed heap (part of the RSS overhead)
MOUNT_READY_TIMEOUT_S = 60.0  # parent waits this long for the daemon's mount
SD_NOTIFY_TIMEOUT_S = 1.0  # one sd_notify datagram to systemd (READY=1, STOPPING=1); past it, logged and dropped

# --- config file (TOML)
CONFIG_PATH_DEFAULT = "/etc/aiturbo/aiturbo.toml"  # what `aiturbo config check` reads without FILE, and the units use
CONFIG_FILE_BYTES_MAX = 1 * MiB  # a config file is a few hundred bytes; a larger one is the wrong file

# --- fabric (peer data plane) -------------------------------------------------------
FABRIC_FRAME_SLACK_BYTES = 4 * KiB  # a frame is at most a chunk plus this (key, header)
FABRIC_FRAME_BYTES_MAX = CHUNK_BYTES + FABRIC_FRAME_SLACK_BYTES  # checked before any payload is allocated
FABRIC_CONTROL_BYTES_MAX = 4 * MiB  # one JSON control body: a round report of a ~50k-chunk file (< the frame max)
FABRIC_MESSAGE_BYTES_MAX = 1 * KiB  # an ERROR / REJECTED reason; longer ones are cut
FABRIC_NODE_NAME_BYTES_MAX = 255  # a node's name in the handshake (UTF-8)
FABRIC_SECRET_BYTES_MIN = 16  # cluster secret: shorter files are refused
FABRIC_SECRET_BYTES_MAX = 4 * KiB  # a bigger "secret" file is a mistake, not a secret
FABRIC_IN_FLIGHT_MAX = 16  # requests outstanding on one connection (client waits, server stops reading)
FABRIC_CONNECTIONS_MAX = 1024  # peer connections one node serves at once; more are closed at once
FABRIC_HASH_THREADS_MAX = 4  # BLAKE3 checks of received chunks running in worker threads
FABRIC_RECEIVE_BYTES = 256 * KiB  # one receive from a stream (bounds per-call allocation)
FABRIC_CONNECT_TIMEOUT_S = 5.0  # open a connection to a peer
FABRIC_HANDSHAKE_TIMEOUT_S = 5.0  # the whole authentication exchange, on either side
FABRIC_CALL_TIMEOUT_S = 30.0  # default per-call bound for get/put/control (an 8 MiB chunk on a slow link)
PEER_UPLOAD_PART_TIMEOUT_S = 150.0  # a part another node's plan gives us: fetch it, send it to the backend
FABRIC_PING_TIMEOUT_S = 5.0  # default bound for ping()
FABRIC_SEND_TIMEOUT_S = 30.0  # a server's reply that the peer does not take in this long breaks the connection
FABRIC_ERROR_SEND_TIMEOUT_S = 1.0  # best-effort ERROR frame before closing a misbehaving connection
FABRIC_ACCEPT_BACKLOG = 128  # listen() backlog / memory-network accept queue
# fabric over RDMA: chunk payloads on RC queue pairs; auth, control and small payloads stay on TCP
FABRIC_RDMA_SLOTS = 16  # registered CHUNK_BYTES buffers per role (lent for our requests / served from): 2 x 16 x 8 MiB pinned
FABRIC_RDMA_SLOTS_MAX = 1024  # a peer that lends more slots than this is refused
FABRIC_RDMA_PAYLOAD_BYTES_MIN = 64 * KiB  # smaller payloads ride in their TCP frame: cheaper than a work request + reply
FABRIC_RDMA_PROBE_BYTES = 4 * KiB  # the page after the lent slots that a server RDMA-reads once to check the path
FABRIC_RDMA_QPS_MAX = 1024  # queue pairs one transport holds (both roles); past it, peers use TCP payloads
FABRIC_RDMA_READS_MAX = 16  # RDMA READs in flight per queue pair (clamped to the device's max_qp_[init_]rd_atom)
FABRIC_RDMA_SETUP_TIMEOUT_S = 5.0  # queue-pair exchange, then path check, with one peer (each step)
FABRIC_RDMA_PROBE_TIMEOUT_S = 2.0  # the path check's RDMA READ; a dead path fails in ~0.5 s (ACK timeout x retries)
FABRIC_RDMA_WR_TIMEOUT_S = 10.0  # one work request; longer means the device or path is stuck: the connection breaks
FABRIC_RDMA_ACK_TIMEOUT = 14  # IB local ACK timeout exponent: 4.096 us x 2^14 = 67 ms per transport try
FABRIC_RDMA_RETRY_COUNT = 7  # transport retries before a work request fails (the IB maximum)
FABRIC_RDMA_RNR_RETRY = 7  # receiver-not-ready retries (7: forever); no SEND/RECV is used, RTS needs a value
FABRIC_RDMA_MIN_RNR_TIMER = 12  # 0.64 ms; unused without SEND/RECV, RTR needs a value
FABRIC_RDMA_HOP_LIMIT = 64  # GRH hop limit (routed RoCE v2)
FABRIC_RDMA_GIDS_MAX = 256  # GID table entries looked at when choosing a port's address
FABRIC_RDMA_POLL_BATCH = 16  # work completions taken per poll call
FABRIC_RDMA_POLL_ROUND_S = 0.05  # pyverbs without a completion-channel fd: one worker-thread polling round...
FABRIC_RDMA_POLL_SLEEP_S = 50e-6  # ...sleeping this long between empty polls

# --- planner (grouped write) ----------------------------------------------------------
PLAN_CACHE_ENTRIES_MAX = 16  # plans kept for repeating chunk patterns (LRU): one per distinct round shape
PLAN_MODELS_MAX = 4  # compiled LPs kept (LRU), one per node count
PLAN_SOLVER_TIME_LIMIT_S = 10.0  # HiGHS gives up on one LP after this
PLAN_IMPROVE_MOVES_MAX = 2000  # local-search moves after rounding one plan
PLAN_IMPROVE_CANDIDATES = 32  # chunks tried per local-search move
PLAN_IMPROVE_GAP = 1e-3  # stop the local search once within 0.1% of the LP bound

# --- controller (membership, group rounds) ----------------------------------------------
NODE_HEARTBEAT_S = 1.0  # a joined node heartbeats this often
NODE_DEAD_AFTER_S = 5.0  # no heartbeat for this long: the node is dead, its DRAM written off
NODES_MAX = 1024  # nodes the controller tracks, whatever their state
CONTROLLER_REQUESTS_PER_PEER_MAX = 256  # one node's requests at once: reports long-poll a whole round
CONTROLLER_BACKEND_GBPS_DEFAULT = 100.0  # aggregate backend bandwidth the planner assumes
GROUP_NAME_BYTES_MAX = 255  # user.aiturbo.group value
GROUPS_TRACKED_MAX = 1024  # groups whose round statistics are kept (the least recently used dropped)
GROUP_CHUNKS_TRACKED_MAX = 1 << 20  # distinct chunk hashes counted per group by the embedded controller
ROUND_WINDOW_S = 0.2  # a round without a group size closes this long after its first report
ROUND_WAIT_MAX_S = 10.0  # every round closes this long after its first report, complete or short
# ... a read round sooner: its readers stop waiting for the plan CLUSTER_READ_WAIT_S after
# open(), so a plan later than that only prefetches what they already fetched alone
READ_ROUND_WAIT_MAX_S = 2.0
ROUND_FILES_MAX = 4096  # files in one round; a full round closes at once
ROUND_PLAN_TIMEOUT_S = 30.0  # dedup lookup + plan of one round; past it every report of the round gets an error
ROUND_PLANS_MAX = 4  # plans of one round while nodes keep dying under it; then its reports get an error

# --- cluster node ---------------------------------------------------------------------
CLUSTER_STATE_POLL_S = 0.5  # waiters re-read a file's state this often (another node may persist it)
CLUSTER_REPLICAS_DEFAULT = 2  # -o replicas in a cluster (1 on a single node)
CLUSTER_FABRIC_GBPS_DEFAULT = 100.0  # -o fabric_gbps: this node's compute-fabric rate, each way
CLUSTER_SNIC_GBPS_DEFAULT = 25.0  # -o snic_gbps: this node's storage-NIC (persist) rate
CLUSTER_REPORT_TIMEOUT_S = 15.0  # a grouped close() waits this long for a round plan, then places alone
CLUSTER_RECONNECT_S = 1.0  # retry period of a lost controller connection
CLUSTER_TAKEOVER_PERIOD_S = 1.0  # how often staged files of dead nodes are looked for
CLUSTER_HOLD_PENDING_S = 120.0  # a received chunk no "hold" claimed is unpinned after this
CLUSTER_SOURCE_WAIT_S = 120.0  # a part another file of the round uploads: wait this long to copy it
CLUSTER_SOURCE_POLL_S = 0.2  # ... looking for its durable copy this often
CLUSTER_READ_PLAN_WAIT_S = 12.0  # a grouped reader waits this long for its read round's plan
CLUSTER_READ_ROUNDS_KEPT = 4096  # (inode, version) read rounds remembered, so a file is reported once per node
CLUSTER_PREFETCH_IN_FLIGHT = 4  # chunks of a grouped read taken from chain predecessors at once per file
CLUSTER_HEAD_FETCHES_IN_FLIGHT = 2  # ... and, beside them, chunks it heads fetched from storage at once
CLUSTER_CHAIN_LINGER_S = 30.0  # after its prefetch, a node keeps serving its chain successors this long
CLUSTER_UNREACHABLE_RETRY_S = 5.0  # a peer that could not be reached is skipped this long
CLUSTER_READ_WAIT_S = 3.0  # ... and reads of it wait this long after open() for the plan, then fetch alone
READ_AHEAD_CHUNKS = 2  # a sequential reader has this many chunks after the current one fetched ahead
PREFETCH_TASKS_MAX = 16  # read-ahead fetches in flight per daemon
CLUSTER_CHAIN_PLAN_SKEW_S = 1.0  # a chunk asked for while our read plan is still coming: wait this long for it
# Grouping without tags (-o autogroup): opens for reading of one version by several nodes
AUTOGROUP_WINDOW_S = 1.0  # ... within this long of the first one's form one read round (sooner: every node joined)
AUTOGROUP_BYTES_MIN = 8 * MiB  # files smaller than a chunk are read alone (a round saves them nothing)
AUTOGROUP_JOIN_WAIT_S = 0.25  # a reader waits this long to learn whether it is first (then it reads at once)
AUTOGROUP_CLAIMS_MAX = 4096  # versions whose first reader the controller remembers (within the window)
OBJECT_CHUNK_HASHES_MAX = 1 << 17  # BLAKE3 of imported objects' named chunks remembered (~1 PiB of chunks)
OBJECT_FILES_TRACKED_MAX = 4096  # imported objects being hashed chunk by chunk towards a manifest

# --- metrics (Prometheus, served on loopback by default) -------------------------------
METRICS_NODE_ADDRESS_DEFAULT = "127.0.0.1:9460"  # -o metrics: a daemon's endpoint (taken: an ephemeral port)
METRICS_CONTROLLER_ADDRESS_DEFAULT = "127.0.0.1:9461"  # aiturbo controller --metrics
METRICS_CLIENTS_MAX = 8  # scrapes served at once
METRICS_REQUEST_BYTES_MAX = 8 * KiB  # an HTTP request head; a longer one is refused
METRICS_CALL_TIMEOUT_S = 5.0  # one scrape: read the request, send the answer
METRICS_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # round and plan times
STATUS_SUMMARY_BYTES_MAX = 1 * KiB  # the per-node summary a heartbeat carries for `aiturbo status`
STATUS_LIST_MAX = 5  # queued files and recent errors `aiturbo status` lists per daemon (one screen)
