"""Rebuilding live objects from the specs a checkpoint records (``build``, ``spec``)."""
