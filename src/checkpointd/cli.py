"""The ``checkpointd`` command line: the demo job and tools to look after a checkpoint root.

Every command takes a local path or an fsspec URL and ``--storage-option
KEY=VALUE`` pairs. Failures print one line on stderr and exit non-zero; a
traceback only with ``--debug``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from checkpointd.errors import CheckpointError

__all__ = ["main"]

Command = Callable[[argparse.Namespace], int]


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


def _cmd_demo(args: argparse.Namespace) -> int:
    from checkpointd.demo import DemoConfig, run_demo

    config = DemoConfig(
        root=args.root,
        steps=args.steps,
        save_every=args.save_every,
        width=args.width,
        keep_last=args.keep_last,
        storage_options=storage_options(args),
    )
    run_demo(config, out=lambda line: print(line, flush=True))
    return 0


def _cmd_ls(args: argparse.Namespace) -> int:
    import msgspec

    from checkpointd.restore import list_checkpoints

    infos = list_checkpoints(args.root, storage_options=storage_options(args))
    if args.json:
        rows = [msgspec.to_builtins(info) for info in infos]
        print(json.dumps(rows, indent=None))
        return 0
    if not infos:
        print(f"no committed checkpoints under {args.root}")
        return 0
    print(f"{'step':>12}  {'created (UTC)':<19}  {'size':>10}  metrics")
    for info in infos:
        created = info.created_at.strftime("%Y-%m-%d %H:%M:%S")
        metrics = " ".join(
            f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.metrics.items()
        )
        print(f"{info.step:>12}  {created:<19}  {_size(info.nbytes):>10}  {metrics}")
    return 0


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--storage-option",
        metavar="KEY=VALUE",
        action="append",
        type=_storage_option,
        help="fsspec storage option (repeatable; dotted keys nest, e.g. client_kwargs.endpoint_url=...)",
    )
    common.add_argument("--debug", action="store_true", help="show tracebacks on failure")

    parser = argparse.ArgumentParser(prog="checkpointd", description=__doc__.splitlines()[0])
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
    demo.set_defaults(handler=_cmd_demo)

    ls = commands.add_parser("ls", parents=[common], help="list committed checkpoints")
    ls.add_argument("root")
    ls.add_argument("--json", action="store_true", help="print one JSON array")
    ls.set_defaults(handler=_cmd_ls)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Command = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        print("checkpointd: interrupted", file=sys.stderr)
        return 130
    except (CheckpointError, OSError, ValueError) as exc:
        if args.debug:
            raise
        print(f"checkpointd {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
