"""The package version, in a module of its own so that any module may import it
without importing the package root (which would be a cycle)."""

__version__ = "0.1.0"
