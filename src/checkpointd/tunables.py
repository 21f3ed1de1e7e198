"""Every tunable number of checkpointd, in one place, each with why it has its value.

Limits that readers enforce (manifest and header sizes, nesting depths) are
part of what a checkpoint may be: raising them makes files that older readers
refuse. The rest trade speed against memory or safety margins and may change
freely. Modules read them as ``tunables.NAME`` at call time, so setting one (or
monkeypatching ``checkpointd.tunables`` in a test) applies from the next call on; no
module binds one at import. The one exception is the ``DEFAULT_*`` values that
public arguments show in their signatures (bound when their module is imported:
pass the argument instead). tests/unit/test_tunables.py keeps it so, and finds
tunable-looking numbers (sizes, timeouts) defined anywhere else.
"""

from __future__ import annotations

# --- writing -----------------------------------------------------------------

CHUNK_BYTES = 16 * 2**20
"""Bytes handed to a sink per write while streaming a file (per-call cost vanishes; one
chunk's digest and write overlap other files'). The default of ``chunk_bytes``."""

DEFAULT_MAX_PENDING = 1
"""Snapshots a writer holds at once by default (one staging buffer each)."""

DEFAULT_MAX_CONCURRENCY = 4
"""Files of one save written at once by default: a disk or an S3 pool kept busy."""

INTERRUPT_POLL_SECONDS = 0.1
"""How late ``save()`` may see a Ctrl-C whose signal did not wake its wait for a buffer."""

DIRECT_MIN_BYTES = 1 << 20
"""Data regions (and aligned writes) of at least this many bytes go through O_DIRECT
(below it a buffered write is as cheap); also whether tensor data starts 4 KiB-aligned."""

S3_PART_BYTES = 16 * 2**20
"""Preferred multipart-upload part size (S3 allows 5 MiB to 5 GiB; grown for huge files)."""

S3_PARALLEL_PARTS = 8
"""Parts of one file uploaded at once, each held in memory until sent (16 MiB parts: up
to 176 MiB per file); 8 beat 4 against moto once parts went through threads."""

S3_READ_PART_BYTES = 64 * 2**20
"""A read from S3 longer than this is split into ranged GETs of this size (s3fs's own
reads go as 50 MiB ranges; moto reads a whole object for every ranged GET, README)."""

S3_READ_PARALLEL = 8
"""Ranged GETs one S3 store has in flight at once (all its reading threads together)."""

COPY_CHUNK_BYTES = 8 * 2**20
"""Bytes one thread copies at a time in ``memory/bytecopy.py`` (captures, memory-tier
landings): the longest the caller waits for a helper that is already copying."""

COPY_THREADS = 4
"""Threads that copy at once in ``memory/bytecopy.py``, the caller included (at most the
cores this process may use): memory bandwidth is shared, more threads gain little."""

COPY_PARALLEL_MIN_BYTES = 32 * 2**20
"""Below this many bytes (four ``COPY_CHUNK_BYTES``) one thread copies everything:
starting helpers would cost more than they save."""

COPY_CHECKED_BYTES = 512 * 2**10
"""``bytecopy.copy_checked``'s step: copied, then checksummed while the bytes are still
in the CPU's cache (half a megabyte fits L2 on current server cores)."""

CAPTURE_CRC_MIN_BYTES = 2**20
"""Tensors at least this large are checksummed by capture as they land; smaller ones when
the plan is made: per tensor, the checked copy and joining CRCs cost more than a read."""

OPTIMIZER_SEARCH_DEPTH = 3
"""How deep overlapped staging looks into a state (dicts, lists) for optimizers whose
``step`` must wait for the copy: enough for a state dict of wrapped optimizers."""

MAX_METADATA_BYTES = 16 * 2**20
"""Encoded metrics plus metadata of one save: a quarter of MAX_MANIFEST_BYTES, the
rest is left to the file list, so every reader accepts the manifest."""

DEFAULT_EXPORT_SHARD_BYTES = 5 * 2**30
"""Default largest shard of an ``--format hf`` export (Hugging Face's default, 5 GiB)."""

DEFAULT_HISTORY_LIMIT = 1000
"""Default ``TrainingProgress(history_limit=)``: values kept per metric. Its history is
copied at every save on the training thread; 100k values cost about 80 ms a save."""

# --- reading -----------------------------------------------------------------

READ_THREADS = 4
"""Threads that read and check the files of one checkpoint at once."""

READ_CHUNK_BYTES = 8 * 2**20
"""Bytes read per call when a file is verified by streaming it, or read in chunks."""

CATALOG_PASSES = 3
"""Listings a catalog scan makes at most while it finds only missing manifests (a step
retention deleted had a newer one committed first: the next pass finds that one)."""

FILE_READ_THREADS = 2
"""Threads that fault in, read and checksum the chunks of one large local file at once
(``load``): faulting fresh memory in is most of the cost and it scales with cores; 4
threads measured no faster than 2 on the 2-vCPU benchmark machine."""

KEEP_MIN_BYTES = 32 * 2**20
"""Loaded files at least this large get memory that is kept for reuse once every tensor
over it is freed (hostmem.py). glibc maps allocations over 32 MiB (its largest mmap
threshold) afresh and unmaps them on free, so without keeping, every load in a
long-lived process faults its whole size in again (~5 us per 4 KiB page on the
benchmark VM: 0.7-0.9 s per 600 MiB); smaller ones come from torch's allocator."""

KEEP_SECONDS = 30.0
"""Seconds a freed load buffer is kept for the next load (an eval loop's), then freed."""

BOUNCE_BYTES = 16 * 2**20
"""Host staging that bytes bound for a device (a CUDA tensor restored into, or
``load(..., map_location="cuda")``) pass through: two reused blocks of half this
each (pinned for CUDA), one read from storage while the other is copied to the device:
a restore's whole extra host memory for device tensors (64 MB bound of issue 21)."""

BOUNCE_CPU_TARGETS = False
"""Whether CPU tensors also go through the bounce path that device tensors take (restore
landings and ``load(..., map_location="cpu")``). Off: a CPU tensor is read into directly,
one copy fewer. Tests turn it on to run the device path where there is no GPU."""

RESTORE_WARNINGS_KEPT = 1024
"""Distinct ``strict=False`` warnings restore remembers so that each is shown once per
process: bounded so that a long job restoring many different states cannot grow it."""

S3_BODY_PIECE_BYTES = 4 * 2**20
"""The most bytes taken at once from an S3 reply's body on the event loop (aiohttp):
large enough to be cheap per call, small enough not to hold the loop."""

S3_SYNC_BODY_PIECE_BYTES = 2**20
"""The most bytes asked of a sync S3 reply at once (botocore, on a worker thread):
urllib3's ``readinto`` reads into a new ``bytes`` of the length asked, then copies, so a
small piece keeps that allocation reused and in cache instead of a fresh range-sized
one faulted in per GET."""

S3_RETRY_FIRST_SECONDS = 0.1
"""The first pause before an S3 request is tried again after a transient error or a
SlowDown; each next one is ``S3_RETRY_GROWTH`` times longer."""

S3_RETRY_GROWTH = 1.7
"""Growth of the pause between S3 tries (exponential backoff, as botocore's own)."""

S3_RETRY_MAX_SECONDS = 15.0
"""The longest pause between two S3 tries, however many came before."""

SHARD_BLOCK_BYTES = 8 * 2**20
"""A shard's bytes carry one CRC32C per block of this size (recorded in the manifest),
so a restore that reads part of a shard (resharding) checks what it read; it reads
whole blocks, at most two more than it needs per piece."""

SHARD_INDEX_MIN_ENTRIES = 4096
"""A many-rank save whose ranks x sharded tensors reach this stores each rank's shard
entries in a shard index file of its own (schema 4), referenced from the manifest, instead
of in the manifest (about 150 bytes an entry: 4,096 is some 600 KB). Smaller jobs keep
them inline (schema 2 or 3: one file fewer per rank, readable by older versions); the
70B FSDP2 job of bench_scale would pass MAX_MANIFEST_BYTES inline at about 215 ranks."""

# --- limits readers enforce (part of the format) --------------------------------

MAX_MANIFEST_BYTES = 64 * 2**20
"""Largest manifest a reader decodes: far above any real one, small enough that a
hostile file cannot exhaust memory."""

MAX_HEADER_BYTES = 256 * 2**20
"""Largest safetensors JSON header a reader parses."""

MAX_JSON_DEPTH = 100
"""Deepest nesting of containers in ``metrics`` or ``metadata`` (their own dict is
level 1). Far below Python's recursion limit, so whatever later walks them
(msgspec, json.dumps, copy.deepcopy, a user's code) cannot hit a RecursionError."""

MAX_TREE_DEPTH = 64
"""Deepest nesting of containers in a component's state tree (its own container is
level 1). Capture refuses deeper states, readers refuse deeper trees as corrupt;
far below what Python's recursion limit and msgspec allow."""

MAX_SPEC_BYTES = 64 * 2**10
"""Largest encoded arguments of one component's spec (``rebuild.spec``): a spec names a
class and small arguments, never tensors; ``build`` refuses larger ones."""

MAX_IMPORT_PATH_CHARS = 256
"""Longest import path (``module.qualname``) a spec may name."""

MAX_BIGINT_BITS = 4096
"""Widest Python int a state may hold (stored as a msgpack extension past 64 bits):
capture refuses wider, so decoding one never costs quadratic time."""

MAX_DCP_INDEX = 2**20
"""Largest list index in a PyTorch DCP checkpoint's flattened paths that importing it
accepts: far above any real state, small enough that a hostile index cannot make a
list of that length."""

# --- retention and garbage collection -----------------------------------------

GRACE_SECONDS = 600.0
"""The shortest time another writer's new checkpoint is safe from this writer's
retention (the grace window is the longer of this and twice the writer's own last
save interval)."""

INCREMENTAL_MIN_BYTES = 64 * 2**10
"""Incremental saves store tensors of at least this many bytes as shared blobs (hashed,
written once); smaller ones stay in the step's own tensor file, rewritten each save."""

GC_OLDER_THAN = 3600.0
"""Default age (seconds without a write) before gc removes a leftover: an hour
without a write means no live writer owns it."""


# --- many ranks ------------------------------------------------------------------
HEARTBEAT_SECONDS = 1.0
"""How often each rank's writer bumps its heartbeat counter in the job's store."""

STALE_SECONDS = 15.0
"""A rank whose heartbeat has not moved for this long is dead: its save fails on every
rank. Many heartbeats long, so a rank that is merely busy (GIL held for a while, a
slow store) is not taken for dead."""

JOIN_SECONDS = 120.0
"""How long the ranks of a save wait for a live rank that has not called save() for the
same step (``if rank == 0: save()``), before the save fails naming it. The default of
a writer's ``join_seconds``."""

POLL_SECONDS = 0.05
"""Longest pause between two looks at the store while a rank waits for the others (the
first pauses are shorter, doubling up to this, so a wait that ends soon ends soon)."""

WAIT_SECONDS = 5.0
"""How often a rank blocked in the store's ``wait`` (on a connection of its own) for a
key another rank will set (the outcome, ``published``) looks at that rank's heartbeat;
at most a third of STALE_SECONDS is used, so a dead publisher is still noticed about
STALE_SECONDS after it stopped. The wait for the outcome goes on beside the looks; the
one for ``published`` is cut into waits this long, each of which, timing out, costs
the store a call and logs two c10d warnings ("likely a timeout")."""

OUTCOME_WAIT_SECONDS = 300.0
"""Longest one blocked wait for an attempt's outcome lasts. Long: dead ranks are noticed
by the task beside it, and each wait that times out logs two c10d warnings."""

PUBLISH_WAIT_SECONDS = 4 * STALE_SECONDS
"""How long a trainer whose service died waits for a committed attempt to be published
(by its publisher, or by a follower standing in for a dead one) before it says it does
not know (daemon/client/follow.py): four times ``STALE_SECONDS``, so a dead publisher is
noticed and stood in for first. Raise it with ``STALE_SECONDS``."""

STORE_VALUE_BYTES = 4 * 2**20
"""Largest value a rank sets in the job's c10d store in one piece; larger ones (a many-rank
manifest, a post with many shards) go as chunks of this size (ranks/values.py). Half the
8 MiB payload the libuv TCPStore accepts."""

# --- the checkpoint service ----------------------------------------------------------
SERVICE_START_SECONDS = 60.0
"""How long ``service="auto"`` waits for a service it started to answer (a cold start
imports torch)."""

SERVICE_START_POLL_SECONDS = 0.05
"""Pause between two tries to connect to a service ``service="auto"`` started."""

SERVICE_AUTO_IDLE_SECONDS = 900.0
"""``--idle-exit`` of a service started by ``service="auto"`` (the environment variable
``CHECKPOINTD_IDLE_EXIT`` overrides it): a quarter hour without a client."""

CONNECT_SECONDS = 10.0
"""How long a client's connect to the service's socket may take before the service is
taken for not answering."""

CLIENT_MAPS_KEPT = 2
"""Segment mappings a trainer keeps for reuse (daemon/client/segments.py): the one being filled
and the one the service keeps or holds as its spare, so nothing stays mapped longer
than a save only for reuse."""

CLIENT_CLOSE_SECONDS = 5.0
"""How long closing a client connection waits for its reader thread to end."""

DEFAULT_SERVICE_NICENESS = 10
"""``checkpointd serve --niceness``: the CPU scheduler gives a niceness-10 thread about a
tenth of a niceness-0 thread's share when both want a core."""

DEFAULT_SERVICE_IO_LEVEL = 7
"""``--io-priority``: best effort, level 7 (the lowest level that still always progresses;
``idle`` only gets the disk when nobody else wants it)."""

IDLE_CHECK_SECONDS = 0.2
"""How often the service looks whether it has been idle for ``--idle-exit``."""

ACCEPT_BACKOFF_MIN_SECONDS = 0.01
"""First pause of the service's accept loop when it is out of file descriptors and has
no spare one; doubled each time, up to ``ACCEPT_BACKOFF_MAX_SECONDS``."""

ACCEPT_BACKOFF_MAX_SECONDS = 1.0
"""Longest pause of the accept loop while out of file descriptors: a second, so
connections get in soon after descriptors free."""

REFUSE_ACCEPT_SECONDS = 0.05
"""How long the service waits to accept the connection it refuses on its spare
descriptor (one is waiting already when accept failed, so it comes at once)."""

MAX_FRAME_BYTES = 64 * 2**20
"""Largest frame of the service's protocol (a ``Submit``: a snapshot's description with
its non-tensor state): refused from its length prefix, before the body is read."""

FRAME_RECEIVE_BYTES = 2**20
"""The most bytes taken from a socket per receive while reading frames."""

FRAME_RECEIVE_MIN_BYTES = 64 * 2**10
"""The service asks for at least this much per receive (a little past the frame it
reads), so many small frames cost few calls."""

SHM_HUGE_PAGES = True
"""The service's shared-memory segments ask for transparent huge pages (granted where
the host's ``shmem_enabled`` is ``advise``, ``within_size`` or ``always``): mapping a
held 605 MB checkpoint then costs under a millisecond instead of ~0.07 s in 4 KiB
pages. The price, on a host whose THP ``defrag`` is ``madvise`` (the default) and
whose memory is fragmented, is a one-off stall while the kernel compacts memory for a
new segment (about 1 s per 600 MB, measured once on the README's VM); segments are
reused from save to save, so it is paid when one is first made."""

MAX_REQUEST_BYTES = 1 << 20
"""Largest frame of a request other than ``Submit`` (``OpenWriter``, ``Alloc``,
``Lookup``...), refused from its first bytes, before the rest is read. The largest real
one is an ``OpenWriter`` of a many-rank job (its group's global ranks, 5 bytes each: a
200,000-rank job). Only a ``Submit`` (a snapshot's description) may reach
``MAX_FRAME_BYTES``."""

MAX_FRAME_ITEMS = 1 << 20
"""Most msgpack objects (every key, value and element) one frame the service reads may
hold, counted by a scan before msgspec decodes it. msgspec holds the GIL for a whole
decode: 60 M empty arrays took 19 s and 4.4 GB, stalling every client and the
heartbeats of many-rank saves. A million decode in about 0.2 s and 75 MB at worst; a
real ``Submit`` of 3,000 tensors holds about 50,000."""

MAX_FRAME_DEPTH = 128
"""Deepest nesting of containers in a frame the service reads: a ``Submit``'s metadata
sits 3 levels down and may nest ``MAX_JSON_DEPTH`` more. Without a bound, 5,000 nested
arrays (5 KB) made msgspec raise RecursionError."""

SMALL_FRAME_BYTES = 64 * 2**10
"""Frames up to this size are scanned and decoded on the service's event loop and take
nothing from ``FRAME_BUFFER_BYTES`` (each connection reads at most one frame at a time,
so they are bounded by ``SERVICE_CONNECTIONS``); larger ones reserve their length from it
first and are scanned and decoded on a worker thread, one at a time."""

FRAME_BUFFER_BYTES = 128 * 2**20
"""Bytes of large frames (over ``SMALL_FRAME_BYTES``) the service buffers at once over
every connection, outside ``--memory-limit`` (which bounds shared memory): two frames of
``MAX_FRAME_BYTES``. A frame that would pass it waits (within ``FRAME_SECONDS``)
until others are decoded or their senders cut off."""

FRAME_SECONDS = 30.0
"""How long the rest of a frame (and its wait for ``FRAME_BUFFER_BYTES``) may take once
its length arrived, on the service's side: a slower sender is cut off, its bytes freed."""

SERVICE_CONNECTIONS = 1024
"""Most connections the service serves at once; at most a quarter of its file
descriptor limit (raised to the hard limit at start), the rest left to segments and
storage. Beyond it a connection gets an error and is closed."""

CLIENT_CONNECTIONS = 64
"""Most connections one client process (by its pid) holds at once: a trainer opens one
per writer and one per restore; more is a leak or an attack on the others' share."""

SERVICE_SEGMENTS = 16384
"""Most shared-memory segments the service holds at once (each is a file descriptor and a
mapping, and the kernel allows 65,530 mappings a process by default); at most half its
file descriptor limit. An allocation past it waits like one past ``--memory-limit``."""

CLIENT_SEGMENTS = 256
"""Most segments one client process holds at once, allocated and not yet submitted or in
its writers' saves in flight (a writer has at most 64 saves pending). Each segment counts
at least a page against ``--memory-limit`` too."""

# --- peer replicas (daemon/server/peerlink.py) ----------------------------------
PEER_HANDSHAKE_SECONDS = 10.0
"""How long a peer connection may take to prove its job's key (its ``Hello`` and
``Proof``) before it is closed; also the connecting side's wait for the answer."""

PEER_CONNECT_SECONDS = 5.0
"""Most a service waits for a peer's TCP connect (a node gone, a port refused)."""

PEER_HANDSHAKE_BYTES = 4096
"""The largest frame a peer may send before it proved its key (a ``Hello``: < 200 B)."""

PEER_MIN_BYTES_PER_SECOND = 16 * 2**20
"""The slowest a replica's bytes may arrive (plus ``FRAME_SECONDS``): a slower sender
(or receiver) is cut off and the replica dropped, its memory freed."""

PEER_CHUNK_BYTES = 4 * 2**20
"""Bytes per send and receive call of a replica's bytes."""

PEER_IDLE_WAIT_SECONDS = 60.0
"""Most a push waits for its sender's, then receiver's saves in flight; then it goes."""

PEER_STORE_SECONDS = 120.0
"""How long a rank waits in the job's store for the other ranks' peer addresses (a
writer with ``replicas=``, a restore with ``service=`` in a many-rank job)."""

# --- framework plugins -----------------------------------------------------------
LIGHTNING_OPEN_WRITERS = 4
"""Writers the Lightning plugin keeps open at once (one per root, the most recent)."""

__all__ = [name for name in list(globals()) if name.isupper()]  # every constant above
