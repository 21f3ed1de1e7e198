"""The package version.

In a module of its own so that any module may import it without importing the package
root (which would be a cycle).
"""

__version__ = "0.1.0"
"""The installed checkpointd's version (PEP 440)."""
