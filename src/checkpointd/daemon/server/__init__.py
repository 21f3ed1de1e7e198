"""The service's side: the ``checkpointd serve`` process, its memory and its writers.

Imports ``daemon.wire``, never ``daemon.client``.
"""
