"""The checkpoint service: a process of its own that owns staged snapshots and finishes
writing them even if the training process dies (README, "The checkpoint service").

- paths.py: the socket's folder, its permissions and the peer credential check
- protocol.py: the typed messages (msgspec structs, a tagged union) and their framing
- shm.py: shared-memory segments (memfd), mapped by the service and its clients
- memtier.py: committed checkpoints held in memory, and the read-only Store over them
- snapshot.py: a captured Snapshot described for the service and rebuilt there, and
  what the memory tier keeps of it once committed
- server.py: the service process (``checkpointd serve``)
- client.py: a connection to the service, and starting one (``service="auto"``)
- remote.py: the writer's side of a save through the service
- recall.py: ``restore(..., service=...)`` from the memory tier

paths, protocol, shm, memtier and client import no torch (``checkpointd status``).
"""
