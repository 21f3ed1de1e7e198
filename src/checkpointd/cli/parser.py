"""The ``checkpointd`` command line's arguments: one parser with a subcommand per tool.

``cli.main`` parses with ``build_parser()`` and dispatches on ``args.command``;
nothing here runs a command or imports torch (``open_root`` turns the
parsed root into its Store).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from checkpointd.storage import Store

__all__ = ["DESCRIPTION", "build_parser", "open_root", "storage_options"]

DESCRIPTION = (
    "The ``checkpointd`` command line: the demo job and tools to look after a checkpoint root."
)


def _storage_option(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value: Any = json.loads(raw)  # numbers, booleans, null, nested JSON
    except json.JSONDecodeError:
        value = raw
    return key, value


def storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``--storage-option`` pairs as fsspec storage options (dotted keys nest)."""
    options: dict[str, Any] = {}
    for key, value in args.storage_option or []:
        target = options
        *parents, leaf = key.split(".")
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = value
    return options or None


@contextlib.contextmanager
def open_root(args: argparse.Namespace) -> Iterator[Store]:
    """The Store of the parsed ``args.root`` (with its storage options), closed on exit."""
    from checkpointd.storage import open_store

    store = open_store(args.root, storage_options(args))
    try:
        yield store
    finally:
        store.close()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command."""
    from checkpointd import tunables

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--storage-option",
        metavar="KEY=VALUE",
        action="append",
        type=_storage_option,
        help="fsspec storage option (repeatable; dotted keys nest, e.g. client_kwargs.endpoint_url=...)",
    )
    common.add_argument("--debug", action="store_true", help="show tracebacks on failure")

    parser = argparse.ArgumentParser(prog="checkpointd", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo", parents=[common], help="train a small model, saving in the background"
    )
    demo.add_argument(
        "root", nargs="?", default="checkpoints", help="where to save (default: ./checkpoints)"
    )
    demo.add_argument(
        "--steps", type=int, default=300, help="steps to train in this run (default 300)"
    )
    demo.add_argument("--save-every", type=int, default=50, help="save every N steps (default 50)")
    demo.add_argument(
        "--width", type=int, default=512, help="hidden width of the model (default 512)"
    )
    demo.add_argument("--keep-last", type=int, default=3, help="checkpoints to keep (default 3)")
    demo.add_argument(
        "--service",
        metavar="SOCKET",
        help='save and resume through the checkpoint service at SOCKET (or "auto")',
    )

    root_help = "checkpoint root: a local path or an fsspec URL (s3://bucket/prefix)"
    ls = commands.add_parser("ls", parents=[common], help="list committed checkpoints")
    ls.add_argument("root", help=root_help)
    ls.add_argument("--json", action="store_true", help="print one JSON array")
    ls.add_argument(
        "--verify",
        action="store_true",
        help="read every byte, mark damaged steps (exit 1 if any; JSON rows gain 'damaged')",
    )

    inspect = commands.add_parser(
        "inspect", parents=[common], help="components, tensors, metadata and files of a checkpoint"
    )
    inspect.add_argument("root", help=root_help)
    inspect.add_argument("--step", type=int, help="the step (default: the newest)")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")

    verify = commands.add_parser(
        "verify", parents=[common], help="read every byte and check sizes and CRC32C"
    )
    verify.add_argument("root", help=root_help)
    which = verify.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="the step (default: the newest)")
    which.add_argument("--all", action="store_true", help="every committed checkpoint")
    shown = verify.add_mutually_exclusive_group()
    shown.add_argument(
        "--progress",
        action="store_true",
        help="always show progress on stderr (default: after 1 s)",
    )
    shown.add_argument("--no-progress", action="store_true", help="never show progress")

    gc = commands.add_parser(
        "gc",
        parents=[common],
        help="show (with --apply: delete) what retention and leftover cleanup would remove",
    )
    gc.add_argument("root", help=root_help)
    gc.add_argument("--apply", action="store_true", help="delete (default: only show)")
    gc.add_argument("--keep-last", type=int, metavar="N", help="keep the newest N checkpoints")
    gc.add_argument("--keep-every", type=int, metavar="K", help="also keep steps divisible by K")
    gc.add_argument(
        "--keep-best", type=int, metavar="K", help="also keep the K best by --best-metric"
    )
    gc.add_argument("--best-metric", metavar="NAME", help="the metrics key --keep-best ranks by")
    gc.add_argument("--best-mode", choices=("min", "max"), default="min", help="default: min")
    gc.add_argument(
        "--older-than",
        type=float,
        default=tunables.GC_OLDER_THAN,
        metavar="SECONDS",
        help=(
            "leftovers untouched this long count as abandoned (default "
            f"{tunables.GC_OLDER_THAN:g}); a live save's files are only dated by their age, "
            "so use small values only when no writer is running"
        ),
    )

    _add_conversions(commands, common, root_help)
    _add_service(commands)
    return parser


def _add_service(commands: Any) -> None:
    """The ``serve`` and ``status`` subcommands (the checkpoint service)."""
    from checkpointd import tunables

    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", help="show tracebacks on failure")
    socket_help = (
        "the service's socket (default: $CHECKPOINTD_SOCKET, else "
        "$XDG_RUNTIME_DIR/checkpointd/sock, else <tempdir>/checkpointd-<uid>/sock)"
    )
    serve = commands.add_parser(
        "serve", parents=[debug], help="run the checkpoint service in the foreground"
    )
    serve.add_argument("--socket", metavar="PATH", help=socket_help)
    serve.add_argument(
        "--memory-limit",
        metavar="SIZE",
        help="most shared memory held, staged and kept (bytes, or K/M/G/T; default: no limit)",
    )
    serve.add_argument(
        "--keep-in-memory",
        type=int,
        default=1,
        metavar="N",
        help="committed checkpoints kept in memory per root for restores (default 1; 0: off)",
    )
    serve.add_argument(
        "--peer-address",
        metavar="HOST",
        default=os.environ.get("CHECKPOINTD_PEER_ADDRESS"),
        help="the address other nodes' services reach this one at for replicas, on an "
        "ephemeral port (default: $CHECKPOINTD_PEER_ADDRESS, else this host name's address)",
    )
    serve.add_argument(
        "--idle-exit",
        type=float,
        metavar="SECONDS",
        help="exit after this long with no client and nothing pending (default: never)",
    )
    serve.add_argument(
        "--niceness",
        type=int,
        default=tunables.DEFAULT_SERVICE_NICENESS,
        choices=range(20),
        metavar="N",
        help="CPU niceness added to the service's (default 10: below training; 0: unchanged)",
    )
    serve.add_argument(
        "--io-priority",
        default=str(tunables.DEFAULT_SERVICE_IO_LEVEL),
        choices=[*"01234567", "idle", "none"],
        help="I/O priority: best-effort level 0-7, idle, or none (default 7, the lowest level)",
    )
    status = commands.add_parser(
        "status", parents=[debug], help="what the checkpoint service is doing"
    )
    status.add_argument("--socket", metavar="PATH", help=socket_help)
    status.add_argument("--json", action="store_true", help="print one JSON object")


def _add_conversions(commands: Any, common: argparse.ArgumentParser, root_help: str) -> None:
    """The ``export`` and ``import`` subcommands."""
    export = commands.add_parser(
        "export",
        parents=[common],
        help="write one component as a .safetensors or .pt file, or a Hugging Face "
        "safetensors folder (--format hf) or a DCP folder (--format dcp)",
    )
    export.add_argument("root", help=root_help)
    export.add_argument("--step", type=int, help="the step (default: the newest)")
    export.add_argument(
        "--component", metavar="NAME", help="component to export (--format dcp: default all)"
    )
    export.add_argument(
        "--format",
        choices=("file", "hf", "dcp"),
        default="file",
        help="file: one FILE; hf: a Hugging Face safetensors folder with its index; "
        "dcp: a torch.distributed.checkpoint folder",
    )
    export.add_argument(
        "--to",
        required=True,
        metavar="PATH",
        help="file: FILE.safetensors (tensors only, dotted names) or FILE.pt (torch.save of "
        "the tree); hf, dcp: a new folder",
    )

    imp = commands.add_parser(
        "import",
        parents=[common],
        help="commit a torch.save file, safetensors file, HF folder or DCP folder as a checkpoint",
    )
    imp.add_argument("source", help="a .pt/.pth/.ckpt, .safetensors, HF folder or DCP folder")
    imp.add_argument("root", help=root_help)
    imp.add_argument("--step", type=int, help="the step (default: Lightning's global_step, else 0)")
    imp.add_argument("--component", metavar="NAME", help="put everything in this one component")
