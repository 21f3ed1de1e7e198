"""mkdocs hook: the command line reference is the parser's own help, made at build time.

A page that holds the line ``<!-- checkpointd --help -->`` gets, in its place, the output
of ``checkpointd --help`` and of ``checkpointd COMMAND --help`` for every command, from
``checkpointd.cli.parser.build_parser`` (so the page cannot drift from the code).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

MARKER = "<!-- checkpointd --help -->"


def _help(parser: argparse.ArgumentParser) -> str:
    os.environ["COLUMNS"] = "96"  # argparse wraps to the terminal's width
    return parser.format_help().rstrip()


def _reference() -> str:
    from checkpointd.cli.parser import build_parser

    parser = build_parser()
    parts = ["```text", "$ checkpointd --help", _help(parser), "```", ""]
    for action in parser._actions:  # noqa: SLF001  (argparse has no public way to list them)
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for name, sub in action.choices.items():
                parts += [f"### `checkpointd {name}`", ""]
                parts += ["```text", f"$ checkpointd {name} --help", _help(sub), "```", ""]
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Put the parser's help where the page asks for it."""
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, _reference())
    return markdown
