"""The ``checkpointd`` command line: the demo job and tools to look after a checkpoint root.

Every command takes a local path or an fsspec URL and ``--storage-option
KEY=VALUE`` pairs. Failures print one line on stderr and exit non-zero; a
traceback only with ``--debug``. Results go to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, TextIO

from checkpointd.errors import CheckpointError, CheckpointNotFoundError

if TYPE_CHECKING:
    from checkpointd.retention import RetentionPolicy
    from checkpointd.storage import Store

__all__ = ["build_parser", "main", "progress_bar", "say", "storage_options"]

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


# ---------------------------------------------------------------------------
# ls


def _cmd_ls(args: argparse.Namespace) -> int:
    import msgspec

    from checkpointd.catalog import list_checkpoints

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
                f"{info.step:>12}  {created:<19}  {_size(info.nbytes):>10}  "
                f"{_size(info.written_nbytes):>10}  {_size(info.referenced_nbytes):>10}  "
                f"{_metrics(info.metrics)}"
            )
        return 0
    print(f"{'step':>12}  {'created (UTC)':<19}  {'size':>10}  metrics")
    for info in infos:
        created = info.created_at.strftime("%Y-%m-%d %H:%M:%S")
        print(f"{info.step:>12}  {created:<19}  {_size(info.nbytes):>10}  {_metrics(info.metrics)}")
    return 0


def _ls_verified(args: argparse.Namespace) -> int:
    """``ls --verify``: every step with a manifest, each file's size and CRC32C checked;
    damaged steps (and unreadable manifests) are marked. Exit 1 if any is damaged."""
    import msgspec

    from checkpointd.catalog import scan, step_path
    from checkpointd.manifest import CheckpointInfo
    from checkpointd.reader import verify_step

    rows: list[tuple[int, CheckpointInfo | None, list[str]]] = []
    seen: dict[tuple[str, int], str | None] = {}  # shared blobs: read once

    def unreadable(step: int, exc: CheckpointError) -> None:
        rows.append((step, None, [f"manifest: {exc}"]))

    with _open(args) as store:
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
        size = _size(info.nbytes) if info else "?"
        if bad:
            status = f"DAMAGED: {bad[0]}" + (f" (+{len(bad) - 1} more)" if len(bad) > 1 else "")
        else:
            status = f"ok  {_metrics(info.metrics) if info else ''}".rstrip()
        print(f"{step:>12}  {created:<19}  {size:>10}  {status}")
    return 1 if damaged else 0


def _metrics(metrics: dict[str, Any]) -> str:
    return " ".join(
        f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
    )


def _size(nbytes: float) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _open(args: argparse.Namespace) -> Iterator[Store]:
    """The Store of ``args.root``, closed on exit."""
    from checkpointd.storage import open_store

    store = open_store(args.root, storage_options(args))
    try:
        yield store
    finally:
        store.close()


# ---------------------------------------------------------------------------
# inspect


def _spec_line(entry: dict[str, Any]) -> str:
    """``kind module.qualname(args) over other`` for one manifest spec."""
    shown = [
        *map(json.dumps, entry["args"]),
        *(f"{k}={json.dumps(v)}" for k, v in entry["kwargs"].items()),
    ]
    over = f" over {entry['of']}" if entry["of"] else ""
    return f"{entry['kind']} {entry['module']}.{entry['qualname']}({', '.join(shown)}){over}"


def _cmd_inspect(args: argparse.Namespace) -> int:
    from checkpointd.describe import describe

    with _open(args) as store:
        info = describe(store, args.step)
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"step {info['step']} at {info['path']}")
    print(f"  created   {info['created_at']}")
    print(
        f"  size      {_size(info['nbytes'])} in {len(info['files'])} files "
        f"(schema {info['schema_version']}, checkpointd {info['library_version']}, "
        f"world size {info['world_size']})"
    )
    if info["blobs"]:
        print(
            f"  shared    {len(info['blobs'])} blobs: this save wrote "
            f"{_size(info['written_nbytes'])}, references {_size(info['referenced_nbytes'])} "
            "stored by earlier saves"
        )
    print(f"  metrics   {_metrics(info['metrics']) or '-'}")
    print(f"  metadata  {json.dumps(info['metadata']) if info['metadata'] else '-'}")
    for name, entry in info["specs"].items():
        print(f"  spec      {name}: {_spec_line(entry)}")
    for name, component in info["components"].items():
        tensors = component["tensors"]
        count = f"{len(tensors)} tensor{'' if len(tensors) == 1 else 's'}"
        print(f"\ncomponent {name}: {count}, {_size(component['nbytes'])}")
        if not tensors:
            continue
        width = max(4, *(len(t["name"]) for t in tensors))
        print(f"  {'name':<{width}}  {'dtype':<9}  {'shape':<14}  {'bytes':>10}")
        for t in tensors:
            shape = "[" + ", ".join(map(str, t["shape"])) + "]"
            print(f"  {t['name']:<{width}}  {t['dtype']:<9}  {shape:<14}  {t['nbytes']:>10}")
    print("\nfiles")
    width = max(4, *(len(f["path"]) for f in info["files"]))
    for f in info["files"]:
        print(f"  {f['path']:<{width}}  {f['size']:>10}  crc32c {f['crc32c']}")
    if info["blobs"]:
        print("\nshared blobs")
        for b in info["blobs"]:
            how = "written" if b["written"] else "referenced"
            print(f"  {b['path']}  {b['size']:>10}  {how}")
    return 0


# ---------------------------------------------------------------------------
# verify


def progress_bar(total: int, mode: Literal["auto", "always", "never"], stream: TextIO) -> Any:
    """A tqdm byte counter on ``stream`` (stderr): "auto" shows it once the work has
    taken a second, "always" from the start, "never" not at all. On a terminal it
    redraws in place; elsewhere at most every 5 s (unless "always")."""
    from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]

    tty = stream.isatty()
    return tqdm(
        total=total,
        desc="verify",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=stream,
        disable=mode == "never",
        delay=0.0 if mode == "always" else 1.0,
        mininterval=0.0 if mode == "always" else (0.2 if tty else 5.0),
        dynamic_ncols=tty,
    )


def say(bar: Any, line: str) -> None:
    """Print ``line`` on stdout; around the bar (cleared, then redrawn) once it is shown.

    tqdm.write would redraw a bar that is still inside its delay, and that bar is
    then never finished with a newline.
    """
    shown = not bar.disable and bar.last_print_t >= bar.start_t + bar.delay
    if shown:
        bar.write(line, file=sys.stdout)
        sys.stdout.flush()
    else:
        print(line, flush=True)


def _verify_targets(store: Store, args: argparse.Namespace) -> tuple[list[Any], list[str]]:
    """The (step, manifest) pairs to verify, and the manifests that failed to read."""
    from checkpointd import catalog

    if not args.all:
        return [catalog.resolve(store, args.step, on_damaged=catalog.raise_damaged)], []
    failures: list[str] = []

    def damaged(step: int, exc: CheckpointError) -> None:
        print(f"step {step}: FAILED: {exc}", flush=True)
        failures.append(str(exc))

    targets = list(catalog.scan(store, newest_first=False, on_damaged=damaged))
    if not targets and not failures:
        raise CheckpointNotFoundError(f"no committed checkpoint under {store.url}")
    return targets, failures


def _cmd_verify(args: argparse.Namespace) -> int:
    from checkpointd.reader import verify_step

    checked = done = 0
    seen: dict[tuple[str, int], str | None] = {}  # a shared blob is read once
    with _open(args) as store:
        targets, failures = _verify_targets(store, args)
        mode: Literal["auto", "always", "never"] = (
            "always" if args.progress else "never" if args.no_progress else "auto"
        )
        unique = {(b.name, b.size): b.size for _, m in targets for b in m.blobs}
        total = sum(f.size for _, m in targets for f in m.files) + sum(unique.values())
        with progress_bar(total, mode, sys.stderr) as bar:
            for step, manifest in targets:
                bad = verify_step(store, step, manifest, bar.update, seen=seen)
                checked += 1
                done += manifest.nbytes
                status = "ok" if not bad else f"FAILED ({len(bad)} bad file(s))"
                say(
                    bar,
                    f"step {step}: {len(manifest.files)} files"
                    + (f" + {len(manifest.blobs)} shared blobs" if manifest.blobs else "")
                    + f", {_size(manifest.nbytes)}: {status}",
                )
                for line in bad:
                    say(bar, f"  bad file {line}")
                failures.extend(bad)
    if failures:
        print(
            f"checkpointd verify: {len(failures)} failure(s); first: {failures[0]}",
            file=sys.stderr,
        )
        return 1
    print(f"verified {checked} checkpoint(s), {_size(done)}: all sizes and CRC32C match")
    return 0


# ---------------------------------------------------------------------------
# gc


def _policy(args: argparse.Namespace) -> RetentionPolicy:
    from checkpointd.retention import RetentionPolicy

    return RetentionPolicy(
        keep_last=args.keep_last,
        keep_every=args.keep_every,
        keep_best=args.keep_best,
        best_metric=args.best_metric,
        best_mode=args.best_mode,
    )


def _rules(policy: RetentionPolicy) -> str:
    rules = [
        f"{name}={getattr(policy, name)}"
        for name in ("keep_last", "keep_every", "keep_best")
        if getattr(policy, name) is not None
    ]
    if policy.keep_best is not None:
        rules.append(f"best_metric={policy.best_metric} ({policy.best_mode})")
    return ", ".join(rules) or "no rule given: every checkpoint is kept"


def _cmd_gc(args: argparse.Namespace) -> int:
    from checkpointd.housekeeping import apply_gc, plan_gc

    policy = _policy(args)
    with _open(args) as store:
        plan = plan_gc(store, policy, older_than=args.older_than)
        print(f"retention ({_rules(policy)}):")
        for info in plan.checkpoints:
            if info.step in plan.retention.reasons:
                reasons = ", ".join(plan.retention.reasons[info.step])
                print(f"  keep    step {info.step:>10}  ({reasons})")
            else:
                print(f"  delete  step {info.step:>10}  {_size(info.nbytes)}")
        if not plan.checkpoints:
            print("  no committed checkpoints")
        if plan.retention.unranked:
            steps = ", ".join(map(str, plan.retention.unranked))
            print(
                f"  note: no metric {policy.best_metric!r} at steps {steps}: keep_best skips them"
            )
        for problem in plan.problems:
            print(f"checkpointd gc: {problem}", file=sys.stderr)
        print(f"leftovers (untouched for {args.older_than:g} s or more, no live writer):")
        for leftover in plan.leftovers:
            print(f"  remove  {leftover.describe()}")
        if not plan.leftovers:
            print("  none")
        if args.apply:
            apply_gc(store, plan)
    verb = "deleted" if args.apply else "would delete"
    print(
        f"{verb} {len(plan.retention.delete)} checkpoint(s) and {len(plan.leftovers)} "
        f"leftover(s), {_size(plan.freed)}"
        + ("" if args.apply else "; rerun with --apply to delete")
    )
    return 0


# ---------------------------------------------------------------------------
# export


def _cmd_export(args: argparse.Namespace) -> int:
    from checkpointd.export import export_component, export_dcp, export_hf

    if args.format == "dcp":
        wanted = None if args.component is None else [args.component]
        done = export_dcp(
            args.root,
            args.to,
            components=wanted,
            step=args.step,
            storage_options=storage_options(args),
        )
        print(f"exported step {done.step} to DCP folder {args.to}: {_size(done.nbytes)}")
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
            f"{args.to}: {done.tensors} tensors, {_size(done.nbytes)}"
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
        f"{summary}, {_size(done.nbytes)}"
    )
    return 0


def _cmd_import(args: argparse.Namespace) -> int:
    from checkpointd.foreign import import_checkpoint

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


# ---------------------------------------------------------------------------
# the parser


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command."""
    from checkpointd.cleanup import DEFAULT_OLDER_THAN

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

    root_help = "checkpoint root: a local path or an fsspec URL (s3://bucket/prefix)"
    ls = commands.add_parser("ls", parents=[common], help="list committed checkpoints")
    ls.add_argument("root", help=root_help)
    ls.add_argument("--json", action="store_true", help="print one JSON array")
    ls.add_argument(
        "--verify",
        action="store_true",
        help="read every byte, mark damaged steps (exit 1 if any; JSON rows gain 'damaged')",
    )
    ls.set_defaults(handler=_cmd_ls)

    inspect = commands.add_parser(
        "inspect", parents=[common], help="components, tensors, metadata and files of a checkpoint"
    )
    inspect.add_argument("root", help=root_help)
    inspect.add_argument("--step", type=int, help="the step (default: the newest)")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(handler=_cmd_inspect)

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
    verify.set_defaults(handler=_cmd_verify)

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
        default=DEFAULT_OLDER_THAN,
        metavar="SECONDS",
        help=(
            "leftovers untouched this long count as abandoned (default "
            f"{DEFAULT_OLDER_THAN:g}); a live save's files are only dated by their age, "
            "so use small values only when no writer is running"
        ),
    )
    gc.set_defaults(handler=_cmd_gc)

    _add_conversions(commands, common, root_help)
    return parser


def _add_conversions(commands: Any, common: argparse.ArgumentParser, root_help: str) -> None:
    """The ``export`` and ``import`` subcommands."""
    export = commands.add_parser(
        "export", parents=[common], help="write one component as a .safetensors or .pt file"
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
    export.set_defaults(handler=_cmd_export)

    imp = commands.add_parser(
        "import",
        parents=[common],
        help="commit a torch.save file, safetensors file, HF folder or DCP folder as a checkpoint",
    )
    imp.add_argument("source", help="a .pt/.pth/.ckpt, .safetensors, HF folder or DCP folder")
    imp.add_argument("root", help=root_help)
    imp.add_argument("--step", type=int, help="the step (default: Lightning's global_step, else 0)")
    imp.add_argument("--component", metavar="NAME", help="put everything in this one component")
    imp.set_defaults(handler=_cmd_import)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Command = args.handler
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
