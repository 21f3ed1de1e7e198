"""The checkpoint service: a process of its own that owns staged snapshots and finishes
writing them even if the training process dies (README, "The checkpoint service").

- paths.py: the socket's folder, its permissions and the peer credential check
- protocol.py: the typed messages (msgspec structs, a tagged union) and their framing
- shm.py: shared-memory segments (memfd), mapped by the service and its clients
- memtier.py: committed checkpoints the service holds in memory, by root
- memstore.py: the read-only Store a restoring client reads a held checkpoint through
- snapshot.py: a captured Snapshot described for the service and rebuilt there, and
  what the memory tier keeps of it once committed
- memory.py: the shared memory the service holds, its limit, and lending to restores
- conn.py: one client connection as the service sees it
- saves.py: the writers opened through the service and their saves
- server.py: the service process (``checkpointd serve``): connections and requests
- priority.py: the service's lower CPU and I/O priority
- follow.py: a many-rank save whose service died, followed to its one outcome
- client.py: a connection to the service, and starting one (``service="auto"``)
- remote.py: the writer's side of a save through the service
- recall.py: ``restore(..., service=...)`` from the memory tier

paths, protocol, shm, memtier, memstore, memory, priority and client import no torch (``checkpointd status``).
"""
