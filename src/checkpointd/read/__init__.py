"""Reading checkpoints back: the catalog of committed steps, the one reader of the
format, load and restore (in place, all or nothing), verification, and descriptions
for ``inspect``."""
