"""The checkpoint service: a process of its own that owns staged snapshots and finishes
writing them even if the training process dies (README, "The checkpoint service").

Three homes, one per side of the socket (docs/architecture.md, "The daemon's sides"):

- ``wire/``: what both sides speak: the messages, frames and their bounds, shared-memory
  segments, the socket's path and lock, and a snapshot's description;
- ``server/``: the service process: connections and admission, its shared memory and
  memory tier, the writers it hosts and what it keeps of their saves, its priority;
- ``client/``: the trainer's side: the connection, the service backend of a writer, its
  staging segments, following a save whose service died, and restoring from memory.

``wire`` imports neither side; ``client`` and ``server`` never import each other.
"""
