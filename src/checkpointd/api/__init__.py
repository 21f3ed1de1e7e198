"""The public front ends, above write/, read/ and daemon/: CheckpointWriter and
AsyncCheckpointWriter (what both share, the backend they open: in process or the
service's), their reads of their own root, and restore (from storage or the service's
memory tier). The package root's lazy names point here."""
