"""checkpointd benchmarks: side-by-side ratios, run with ``python -m benchmarks.run``."""
