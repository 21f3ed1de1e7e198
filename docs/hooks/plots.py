"""mkdocs hook: serve the benchmark plots of benchmarks/results/ as plots/<name>.png.

The plots are written by `python -m benchmarks.run` next to its JSON; the site links them
without keeping a second copy in docs/. A plot that is not there is simply not served
(`mkdocs build --strict` then names the page that links it).
"""

from __future__ import annotations

import pathlib
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def on_files(files: Files, config: Any) -> Files:
    """Add every PNG of benchmarks/results/ to the site under plots/."""
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"plots/{png.name}", abs_src_path=str(png)))
    return files
