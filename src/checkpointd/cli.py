"""The ``checkpointd`` command line: the demo job and tools to look after a checkpoint root.

Every command takes a local path or an fsspec URL and ``--storage-option
KEY=VALUE`` pairs. Failures print one line on stderr and exit non-zero; a
traceback only with ``--debug``. Results go to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO, TYPE_CHECKING, Any, Literal, TextIO

from checkpointd.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError

if TYPE_CHECKING:
    import torch

    from checkpointd.manifest import FileEntry, Manifest
    from checkpointd.retention import RetentionPolicy
    from checkpointd.storage import Store

__all__ = ["Progress", "build_parser", "describe", "flat_tensors", "main", "storage_options"]

Command = Callable[[argparse.Namespace], int]
READ_CHUNK = 8 * 2**20


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
        print(f"{info.step:>12}  {created:<19}  {_size(info.nbytes):>10}  {_metrics(info.metrics)}")
    return 0


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


def _manifest(store: Store, step: int | None) -> tuple[int, Manifest]:
    """(step, manifest) of ``step``, or of the newest step folder that has a manifest.

    Unlike ``load``, a newest manifest that is damaged is an error here, not skipped:
    these are the tools that should show it.
    """
    from checkpointd import catalog
    from checkpointd.manifest import MANIFEST_NAME, step_dirname

    if step is not None:
        return step, catalog.read_manifest(store, step)
    for found in reversed(catalog.step_folders(store)):
        if store.exists(f"{step_dirname(found)}/{MANIFEST_NAME}"):
            return found, catalog.read_manifest(store, found)
    raise CheckpointNotFoundError(f"no committed checkpoint under {store.url}")


# ---------------------------------------------------------------------------
# inspect


def describe(store: Store, step: int | None) -> dict[str, Any]:
    """What ``inspect`` shows, as JSON-able data. Reads the manifest and tensor headers only."""
    from checkpointd import catalog
    from checkpointd.format import header_length, parse_safetensors_header
    from checkpointd.manifest import step_dirname

    found, manifest = _manifest(store, step)
    folder = step_dirname(found)
    where = catalog.step_path(store, found)
    sizes = {f.path: f.size for f in manifest.files}
    components: dict[str, Any] = {}
    for name, entry in manifest.components.items():
        tensors: list[dict[str, Any]] = []
        for tensor_file in entry.tensors:
            path, size = f"{folder}/{tensor_file}", sizes[tensor_file]
            actual = store.size(path)
            if actual != size:
                raise CorruptCheckpointError(
                    f"{where}/{tensor_file}: size {actual} does not match the manifest's {size}"
                )
            at = f"{where}/{tensor_file}"
            length = header_length(store.read_bytes(path, 0, 8), size, where=at)
            header = store.read_bytes(path, 8, length)
            entries = parse_safetensors_header(header, size - 8 - length, where=at)
            tensors.extend(
                {
                    "name": e.name,
                    "dtype": str(e.dtype).removeprefix("torch."),
                    "shape": list(e.shape),
                    "nbytes": e.end - e.begin,
                    "file": tensor_file,
                }
                for e in sorted(entries, key=lambda e: e.begin)
            )
        components[name] = {
            "tree": entry.tree,
            "tensor_files": list(entry.tensors),
            "nbytes": entry.nbytes,
            "tensors": tensors,
        }
    return {
        "step": found,
        "path": where,
        "created_at": manifest.created_at.isoformat(),
        "nbytes": manifest.nbytes,
        "schema_version": manifest.schema_version,
        "library_version": manifest.library_version,
        "world_size": manifest.world_size,
        "metrics": manifest.metrics,
        "metadata": manifest.metadata,
        "components": components,
        "files": [
            {"path": f.path, "size": f.size, "crc32c": f"{f.crc32c:08x}"} for f in manifest.files
        ],
    }


def _cmd_inspect(args: argparse.Namespace) -> int:
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
    print(f"  metrics   {_metrics(info['metrics']) or '-'}")
    print(f"  metadata  {json.dumps(info['metadata']) if info['metadata'] else '-'}")
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
    return 0


# ---------------------------------------------------------------------------
# verify


class Progress:
    """Bytes done, rate and time left on ``stream`` (stderr), redrawn at most every so often.

    ``mode`` "auto" shows it only once the work has taken ``delay`` seconds,
    "always" from the first update, "never" not at all. On a terminal the line
    is redrawn in place (every 0.2 s); elsewhere each update is a new line (every 5 s).
    """

    def __init__(
        self,
        total: int,
        stream: TextIO,
        mode: Literal["auto", "always", "never"] = "auto",
        delay: float = 1.0,
    ) -> None:
        self.total = total
        self.done = 0
        self.stream = stream
        self.mode = mode
        self.tty = stream.isatty()
        self.delay = 0.0 if mode == "always" else delay
        self.interval = 0.0 if mode == "always" else (0.2 if self.tty else 5.0)
        self.started = time.monotonic()
        self._drawn_at: float | None = None

    def advance(self, nbytes: int) -> None:
        """Count ``nbytes`` more as done; redraw if due."""
        self.done += nbytes
        if self.mode == "never":
            return
        now = time.monotonic()
        if now - self.started < self.delay:
            return
        if self._drawn_at is not None and now - self._drawn_at < self.interval:
            return
        self._drawn_at = now
        self._draw(now)

    def line(self, now: float | None = None) -> str:
        """The progress line: bytes done of total, percentage, rate and time left."""
        elapsed = max((time.monotonic() if now is None else now) - self.started, 1e-9)
        rate = self.done / elapsed
        left = (self.total - self.done) / rate if rate > 0 else math.inf
        percent = 100.0 * self.done / self.total if self.total else 100.0
        eta = "?" if math.isinf(left) else f"{left:.0f} s"
        return (
            f"verify: {_size(self.done)} / {_size(self.total)} ({percent:3.0f}%), "
            f"{_size(rate)}/s, {eta} left"
        )

    def _draw(self, now: float) -> None:
        if self.tty:
            self.stream.write(f"\r\x1b[K{self.line(now)}")
        else:
            self.stream.write(f"{self.line(now)}\n")
        self.stream.flush()

    def finish(self) -> None:
        """End the display with a final line, if anything was drawn."""
        if self._drawn_at is not None:
            self._draw(time.monotonic())
            if self.tty:
                self.stream.write("\n")
            self.stream.flush()


def _verify_file(store: Store, folder: str, entry: FileEntry, progress: Progress) -> str | None:
    """Read every byte of one file; return what is wrong with it, or None if it checks out."""
    from checkpointd.checksum import crc32c
    from checkpointd.errors import StorageNotFoundError

    path = f"{folder}/{entry.path}"
    try:
        size = store.size(path)
    except StorageNotFoundError:
        return "listed in the manifest but missing"
    if size != entry.size:
        return f"size {size} does not match the manifest's {entry.size}"
    buffer = bytearray(min(READ_CHUNK, size))
    digest = 0
    for offset in range(0, size, READ_CHUNK):
        view = memoryview(buffer)[: min(READ_CHUNK, size - offset)]
        store.read_into(path, view, offset)
        digest = crc32c(view, digest)
        progress.advance(len(view))
    if digest != entry.crc32c:
        return f"CRC32C {digest:08x} does not match the manifest's {entry.crc32c:08x}"
    return None


def _verify_targets(
    store: Store, args: argparse.Namespace
) -> tuple[list[tuple[int, Manifest]], list[str]]:
    """The (step, manifest) pairs to verify, and the manifests that failed to read."""
    from checkpointd import catalog
    from checkpointd.manifest import MANIFEST_NAME, step_dirname

    if not args.all:
        return [_manifest(store, args.step)], []
    targets: list[tuple[int, Manifest]] = []
    failures: list[str] = []
    for step in catalog.step_folders(store):
        if not store.exists(f"{step_dirname(step)}/{MANIFEST_NAME}"):
            continue  # not a checkpoint: a save in progress or a leftover
        try:
            targets.append((step, catalog.read_manifest(store, step)))
        except CheckpointError as exc:
            print(f"step {step}: FAILED: {exc}", flush=True)
            failures.append(str(exc))
    if not targets and not failures:
        raise CheckpointNotFoundError(f"no committed checkpoint under {store.url}")
    return targets, failures


def _cmd_verify(args: argparse.Namespace) -> int:
    from checkpointd import catalog
    from checkpointd.manifest import step_dirname

    checked = 0
    with _open(args) as store:
        targets, failures = _verify_targets(store, args)
        mode: Literal["auto", "always", "never"] = (
            "always" if args.progress else "never" if args.no_progress else "auto"
        )
        progress = Progress(sum(m.nbytes for _, m in targets), sys.stderr, mode)
        try:
            for step, manifest in targets:
                folder = step_dirname(step)
                where = catalog.step_path(store, step)
                bad: list[str] = []
                for entry in manifest.files:
                    problem = _verify_file(store, folder, entry, progress)
                    if problem is not None:
                        bad.append(f"{where}/{entry.path}: {problem}")
                checked += 1
                status = "ok" if not bad else f"FAILED ({len(bad)} bad file(s))"
                print(
                    f"step {step}: {len(manifest.files)} files, {_size(manifest.nbytes)}: {status}",
                    flush=True,
                )
                for line in bad:
                    print(f"  bad file {line}", flush=True)
                failures.extend(bad)
        finally:
            progress.finish()
    if failures:
        print(
            f"checkpointd verify: {len(failures)} failure(s); first: {failures[0]}",
            file=sys.stderr,
        )
        return 1
    print(f"verified {checked} checkpoint(s), {_size(progress.done)}: all sizes and CRC32C match")
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
    from checkpointd import catalog
    from checkpointd.cleanup import remove_leftovers, scan_leftovers
    from checkpointd.retention import delete_checkpoint as _delete_checkpoint
    from checkpointd.retention import plan_retention

    policy = _policy(args)
    with _open(args) as store:
        checkpoints = catalog.infos(store)
        plan = plan_retention(checkpoints, policy)
        print(f"retention ({_rules(policy)}):")
        for info in checkpoints:
            if info.step in plan.reasons:
                print(f"  keep    step {info.step:>10}  ({', '.join(plan.reasons[info.step])})")
            else:
                print(f"  delete  step {info.step:>10}  {_size(info.nbytes)}")
        if not checkpoints:
            print("  no committed checkpoints")
        if plan.unranked:
            steps = ", ".join(map(str, plan.unranked))
            print(
                f"  note: no metric {policy.best_metric!r} at steps {steps}: keep_best skips them"
            )
        scan = scan_leftovers(store, older_than=args.older_than)
        leftovers = scan.leftovers
        for problem in scan.problems:
            print(f"checkpointd gc: {problem}", file=sys.stderr)
        print(f"leftovers (untouched for {args.older_than:g} s or more, no live writer):")
        for leftover in leftovers:
            print(f"  remove  {leftover.describe()}")
        if not leftovers:
            print("  none")
        if args.apply:
            for victim in plan.delete:
                _delete_checkpoint(store, victim.step)
            remove_leftovers(store, leftovers)
    freed = sum(v.nbytes for v in plan.delete) + sum(x.nbytes for x in leftovers)
    verb = "deleted" if args.apply else "would delete"
    print(
        f"{verb} {len(plan.delete)} checkpoint(s) and {len(leftovers)} leftover(s), {_size(freed)}"
        + ("" if args.apply else "; rerun with --apply to delete")
    )
    return 0


# ---------------------------------------------------------------------------
# export


def flat_tensors(tree: Any) -> tuple[dict[str, torch.Tensor], int]:
    """Every tensor (or NumPy array) of a state tree under its dotted path, and how many
    non-tensor leaves were left out. Raises ValueError if two paths give the same name."""
    import numpy as np
    import torch

    found: dict[str, torch.Tensor] = {}
    skipped = 0

    def visit(value: Any, path: tuple[str, ...]) -> None:
        nonlocal skipped
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        if isinstance(value, torch.Tensor):
            name = ".".join(path) or "tensor"
            if name in found:
                raise ValueError(f"two tensors would both be named {name!r} in the export")
            found[name] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                visit(item, (*path, str(key)))
        elif isinstance(value, list | tuple):
            for index, item in enumerate(value):
                visit(item, (*path, str(index)))
        else:
            skipped += 1

    visit(tree, ())
    return found, skipped


def write_safetensors(tensors: dict[str, torch.Tensor], file: IO[bytes]) -> int:
    """Write ``tensors`` to ``file`` in the safetensors layout (a copy per name, so aliased
    tensors come out as separate entries); return the bytes written."""
    import torch

    from checkpointd.format import TensorEntry, encode_safetensors_header

    entries: list[TensorEntry] = []
    datas: list[torch.Tensor] = []
    position = 0
    for name, tensor in tensors.items():
        plain = tensor.detach().cpu().contiguous()
        nbytes = plain.numel() * plain.element_size()
        entries.append(
            TensorEntry(name, plain.dtype, tuple(plain.shape), position, position + nbytes)
        )
        datas.append(plain)
        position += nbytes
    header = encode_safetensors_header(entries)
    file.write(header)
    for plain in datas:
        if plain.numel():
            file.write(plain.reshape(-1).view(torch.uint8).numpy().data)
    return len(header) + position


def _cmd_export(args: argparse.Namespace) -> int:
    import torch

    from checkpointd.restore import load

    target: str = args.to
    kind = os.path.splitext(target)[1].lower()
    if kind not in (".safetensors", ".pt"):
        raise ValueError(f"--to {target}: the file name must end in .safetensors or .pt")
    checkpoint = load(
        args.root, args.step, components=[args.component], storage_options=storage_options(args)
    )
    tree = checkpoint.state[args.component]
    folder = os.path.dirname(os.path.abspath(target))
    temp = os.path.join(folder, f".{os.path.basename(target)}.tmp-{os.getpid()}")
    try:
        if kind == ".safetensors":
            tensors, skipped = flat_tensors(tree)
            with open(temp, "wb") as file:
                nbytes = write_safetensors(tensors, file)
            summary = f"{len(tensors)} tensors" + (
                f" ({skipped} non-tensor values left out)" if skipped else ""
            )
        else:
            torch.save(tree, temp)
            nbytes = os.path.getsize(temp)
            summary = "its whole state tree"
        os.replace(temp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
    print(
        f"exported component {args.component!r} of step {checkpoint.info.step} to {target}: "
        f"{summary}, {_size(nbytes)}"
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

    export = commands.add_parser(
        "export", parents=[common], help="write one component as a .safetensors or .pt file"
    )
    export.add_argument("root", help=root_help)
    export.add_argument("--step", type=int, help="the step (default: the newest)")
    export.add_argument("--component", required=True, metavar="NAME", help="component to export")
    export.add_argument(
        "--to",
        required=True,
        metavar="FILE",
        help="FILE.safetensors (tensors only, dotted names) or FILE.pt (torch.save of the tree)",
    )
    export.set_defaults(handler=_cmd_export)
    return parser


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
