"""The ``checkpointd`` command line: the demo job and tools to look after a checkpoint root.

Every command takes a local path or an fsspec URL and ``--storage-option
KEY=VALUE`` pairs. Failures print one line on stderr and exit non-zero; a
traceback only with ``--debug``. Results go to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from checkpointd.cli import maintain as cli_maintain
from checkpointd.cli import service as cli_service
from checkpointd.cli.output import (
    metrics_text,
    progress_bar,
    say,
    shards_text,
    size_text,
    spec_text,
)
from checkpointd.cli.parser import build_parser, open_root, storage_options
from checkpointd.errors import CheckpointError

if TYPE_CHECKING:
    pass

__all__ = ["build_parser", "main", "progress_bar", "say", "storage_options"]

Command = Callable[[argparse.Namespace], int]


def _cmd_demo(args: argparse.Namespace) -> int:
    """``checkpointd demo ROOT``: train a small model, saving as it goes.

    Args:
        args: The parsed command line (cli/parser.py).

    Returns:
        The exit status: 0.
    """
    from checkpointd.cli.demo import DemoConfig, run_demo

    config = DemoConfig(
        root=args.root,
        steps=args.steps,
        save_every=args.save_every,
        width=args.width,
        keep_last=args.keep_last,
        storage_options=storage_options(args),
        service=args.service,
    )
    run_demo(config, out=lambda line: print(line, flush=True))
    return 0


# ---------------------------------------------------------------------------
# ls


def _cmd_ls(args: argparse.Namespace) -> int:
    """``checkpointd ls ROOT``: the committed checkpoints, a table or ``--json``.

    Args:
        args: The parsed command line (cli/parser.py).

    Returns:
        The exit status: 0; with ``--verify``, 1 if a checkpoint is damaged.
    """
    import msgspec

    from checkpointd.read.catalog import list_checkpoints

    if args.verify:
        return _ls_verified(args)
    infos = list_checkpoints(args.root, storage_options=storage_options(args))
    if args.json:
        rows = [
            {**msgspec.to_builtins(info), "written_nbytes": info.written_nbytes} for info in infos
        ]
        print(json.dumps(rows, indent=None))
        return 0
    if not infos:
        print(f"no committed checkpoints under {args.root}")
        return 0
    if any(info.referenced_nbytes for info in infos):
        # Incremental saves: how much each save wrote, and how much it references.
        print(
            f"{'step':>12}  {'created (UTC)':<19}  {'size':>10}  {'written':>10}  "
            f"{'referenced':>10}  metrics"
        )
        for info in infos:
            created = info.created_at.strftime("%Y-%m-%d %H:%M:%S")
            print(
                f"{info.step:>12}  {created:<19}  {size_text(info.nbytes):>10}  "
                f"{size_text(info.written_nbytes):>10}  {size_text(info.referenced_nbytes):>10}  "
                f"{metrics_text(info.metrics)}"
            )
        return 0
    print(f"{'step':>12}  {'created (UTC)':<19}  {'size':>10}  metrics")
    for info in infos:
        created = info.created_at.strftime("%Y-%m-%d %H:%M:%S")
        print(
            f"{info.step:>12}  {created:<19}  {size_text(info.nbytes):>10}  {metrics_text(info.metrics)}"
        )
    return 0


def _ls_verified(args: argparse.Namespace) -> int:
    """``ls --verify``.

    Every step with a manifest, each file's size and CRC32C checked; damaged steps (and unreadable
    manifests) are marked. Exit 1 if any is damaged.
    """
    import msgspec

    from checkpointd.format.manifest import CheckpointInfo
    from checkpointd.read.catalog import scan, step_path
    from checkpointd.read.verify import verify_step

    rows: list[tuple[int, CheckpointInfo | None, list[str]]] = []
    seen: dict[tuple[str, int], str | None] = {}  # shared blobs: read once

    def unreadable(step: int, exc: CheckpointError) -> None:
        rows.append((step, None, [f"manifest: {exc}"]))

    with open_root(args) as store:
        for step, manifest in scan(store, newest_first=False, on_damaged=unreadable):
            found = CheckpointInfo.from_manifest(manifest, step_path(store, step))
            rows.append((step, found, verify_step(store, step, manifest, seen=seen)))
    rows.sort(key=lambda row: row[0])
    damaged = any(bad for _, _, bad in rows)
    if args.json:
        out = [
            {**(msgspec.to_builtins(info) if info else {"step": step}), "damaged": bad}
            for step, info, bad in rows
        ]
        print(json.dumps(out, indent=None))
        return 1 if damaged else 0
    if not rows:
        print(f"no committed checkpoints under {args.root}")
        return 0
    print(f"{'step':>12}  {'created (UTC)':<19}  {'size':>10}  status / metrics")
    for step, info, bad in rows:
        created = info.created_at.strftime("%Y-%m-%d %H:%M:%S") if info else "?"
        size = size_text(info.nbytes) if info else "?"
        if bad:
            status = f"DAMAGED: {bad[0]}" + (f" (+{len(bad) - 1} more)" if len(bad) > 1 else "")
        else:
            status = f"ok  {metrics_text(info.metrics) if info else ''}".rstrip()
        print(f"{step:>12}  {created:<19}  {size:>10}  {status}")
    return 1 if damaged else 0


# ---------------------------------------------------------------------------
# inspect


def _cmd_inspect(args: argparse.Namespace) -> int:
    """``checkpointd inspect ROOT [--step N]``: one checkpoint's components and tensors.

    Args:
        args: The parsed command line (cli/parser.py).

    Returns:
        The exit status: 0.
    """
    from checkpointd.read.describe import describe

    with open_root(args) as store:
        info = describe(store, args.step)
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"step {info['step']} at {info['path']}")
    print(f"  created   {info['created_at']}")
    print(
        f"  size      {size_text(info['nbytes'])} in {len(info['files'])} files "
        f"(schema {info['schema_version']}, checkpointd {info['library_version']}, "
        f"world size {info['world_size']})"
    )
    if info["blobs"]:
        print(
            f"  shared    {len(info['blobs'])} blobs: this save wrote "
            f"{size_text(info['written_nbytes'])}, references "
            f"{size_text(info['referenced_nbytes'])} stored by earlier saves"
        )
    print(f"  metrics   {metrics_text(info['metrics']) or '-'}")
    print(f"  metadata  {json.dumps(info['metadata']) if info['metadata'] else '-'}")
    for name, entry in info["specs"].items():
        print(f"  spec      {name}: {spec_text(entry)}")
    for name, component in info["components"].items():
        tensors = component["tensors"]
        count = f"{len(tensors)} tensor{'' if len(tensors) == 1 else 's'}"
        print(f"\ncomponent {name}: {count}, {size_text(component['nbytes'])}")
        if not tensors:
            continue
        width = max(4, *(len(t["name"]) for t in tensors))
        print(f"  {'name':<{width}}  {'dtype':<9}  {'shape':<14}  {'bytes':>10}")
        for t in tensors:
            shape = "[" + ", ".join(map(str, t["shape"])) + "]"
            shards = shards_text(t.get("shards"))
            print(
                f"  {t['name']:<{width}}  {t['dtype']:<9}  {shape:<14}  {t['nbytes']:>10}{shards}"
            )
    print("\nfiles")
    width = max(4, *(len(f["path"]) for f in info["files"]))
    for f in info["files"]:
        rank = f"  rank {f['rank']}" if info["world_size"] > 1 else ""
        print(f"  {f['path']:<{width}}  {f['size']:>10}  crc32c {f['crc32c']}{rank}")
    if info["blobs"]:
        print("\nshared blobs")
        for b in info["blobs"]:
            how = "written" if b["written"] else "referenced"
            print(f"  {b['path']}  {b['size']:>10}  {how}")
    return 0


# ---------------------------------------------------------------------------
# export


def _cmd_export(args: argparse.Namespace) -> int:
    """``checkpointd export ROOT --to PATH``: a checkpoint as .safetensors, .pt, HF or DCP.

    Args:
        args: The parsed command line (cli/parser.py).

    Returns:
        The exit status: 0.

    Raises:
        ValueError: A ``--format`` other than dcp without ``--component`` (``main``
            prints it; status 1).
    """
    from checkpointd.interop.export import export_component, export_dcp, export_hf

    if args.format == "dcp":
        wanted = None if args.component is None else [args.component]
        done = export_dcp(
            args.root,
            args.to,
            components=wanted,
            step=args.step,
            storage_options=storage_options(args),
        )
        print(f"exported step {done.step} to DCP folder {args.to}: {size_text(done.nbytes)}")
        return 0
    if args.component is None:
        raise ValueError(f"--format {args.format} needs --component NAME")
    if args.format == "hf":
        done = export_hf(
            args.root,
            args.component,
            args.to,
            step=args.step,
            storage_options=storage_options(args),
        )
        print(
            f"exported component {args.component!r} of step {done.step} to Hugging Face folder "
            f"{args.to}: {done.tensors} tensors, {size_text(done.nbytes)}"
        )
        return 0
    done = export_component(
        args.root,
        args.component,
        args.to,
        step=args.step,
        storage_options=storage_options(args),
    )
    if done.tensors < 0:
        summary = "its whole state tree"
    else:
        summary = f"{done.tensors} tensors" + (
            f" ({done.skipped} non-tensor values left out)" if done.skipped else ""
        )
    print(
        f"exported component {args.component!r} of step {done.step} to {args.to}: "
        f"{summary}, {size_text(done.nbytes)}"
    )
    return 0


def _cmd_import(args: argparse.Namespace) -> int:
    """``checkpointd import SOURCE ROOT``: commit a foreign checkpoint as one of ROOT's.

    Args:
        args: The parsed command line (cli/parser.py).

    Returns:
        The exit status: 0.
    """
    from checkpointd.interop.foreign import import_checkpoint

    done = import_checkpoint(
        args.source,
        args.root,
        step=args.step,
        component=args.component,
        storage_options=storage_options(args),
    )
    print(
        f"imported {done.kind} checkpoint {args.source} as step {done.step} of {args.root}: "
        f"components {', '.join(done.components)}"
    )
    return 0


_HANDLERS: dict[str, Command] = {
    "demo": _cmd_demo,
    "ls": _cmd_ls,
    "inspect": _cmd_inspect,
    "verify": cli_maintain.cmd_verify,
    "gc": cli_maintain.cmd_gc,
    "export": _cmd_export,
    "import": _cmd_import,
    "serve": cli_service.cmd_serve,
    "status": cli_service.cmd_status,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return the exit status.

    A CheckpointError, OSError or ValueError is printed as one line on stderr (status 1);
    Ctrl-C is status 130, a closed stdout 141.

    Args:
        argv: The arguments after the program name; None: ``sys.argv[1:]``.

    Returns:
        The exit status of the command (0 on success).

    Raises:
        CheckpointError: With ``--debug``, the command's error instead of status 1.
        OSError: With ``--debug``, likewise.
        ValueError: With ``--debug``, likewise.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Command = _HANDLERS[args.command]
    try:
        status = handler(args)
        sys.stdout.flush()  # a closed pipe must surface here, not at interpreter exit
        return status
    except BrokenPipeError:
        return _closed_pipe()
    except KeyboardInterrupt:
        print("checkpointd: interrupted", file=sys.stderr)
        return 130
    except (CheckpointError, OSError, ValueError) as exc:
        if args.debug:
            raise
        print(f"checkpointd {args.command}: error: {exc}", file=sys.stderr)
        return 1


def _closed_pipe() -> int:
    """The reader of stdout went away (``checkpointd ls ROOT | head -1``): stop quietly.

    Output is pointed at /dev/null so the interpreter's final flush cannot fail again;
    the status is the shell's for a process ended by SIGPIPE, as coreutils tools give.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + 13


if __name__ == "__main__":
    sys.exit(main())
