"""mkdocs hook: the site's home page is the README, with its links made site-relative.

docs/index.md holds only the line ``<!-- README.md -->``; the README's ``docs/X.md`` links
become ``X.md``, so both read the same text and neither drifts from the other.
"""

from __future__ import annotations

import pathlib
from typing import Any

MARKER = "<!-- README.md -->"
README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Put the README, links rewritten, where the page asks for it."""
    if MARKER in markdown:
        text = README.read_text().replace("](docs/", "](")
        markdown = markdown.replace(MARKER, text)
    return markdown
