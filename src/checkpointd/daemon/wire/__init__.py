"""What the trainer and the service both speak: messages, frames, segments, the socket.

Imports nothing from ``daemon.client`` or ``daemon.server`` and no torch outside
``snapshot.py`` (``checkpointd status`` stays light).
"""
