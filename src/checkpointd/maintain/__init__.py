"""Keeping a root tidy: retention policies and lineage, leftovers of crashed saves,
crash-safe removal of a root, shared blobs and their references, and ``gc``."""
