"""The trainer's side: connecting to (or starting) the service, saving and restoring through it.

Imports ``daemon.wire``, never ``daemon.server``.
"""
