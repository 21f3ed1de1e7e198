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
from typing import TYPE_CHECKING, Any, Literal

from checkpointd import cli_service
from checkpointd.cli_format import (
    metrics_text,
    progress_bar,
    say,
    shards_text,
    size_text,
    spec_text,
)
from checkpointd.cli_parser import build_parser, storage_options
from checkpointd.errors import CheckpointError, CheckpointNotFoundError

if TYPE_CHECKING:
    from checkpointd.retention import RetentionPolicy
    from checkpointd.storage import Store

__all__ = ["build_parser", "main", "progress_bar", "say", "storage_options"]

Command = Callable[[argparse.Namespace], int]


def _cmd_demo(args: argparse.Namespace) -> int:
    from checkpointd.demo import DemoConfig, run_demo

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
        size = size_text(info.nbytes) if info else "?"
        if bad:
            status = f"DAMAGED: {bad[0]}" + (f" (+{len(bad) - 1} more)" if len(bad) > 1 else "")
        else:
            status = f"ok  {metrics_text(info.metrics) if info else ''}".rstrip()
        print(f"{step:>12}  {created:<19}  {size:>10}  {status}")
    return 1 if damaged else 0


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
# verify


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

    checked = done = 0  # done: bytes read (a shared blob once, however many steps use it)
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
                read = [0]

                def counted(n: int, read: list[int] = read) -> None:
                    read[0] += n
                    bar.update(n)

                before = len(seen)
                bad = verify_step(store, step, manifest, counted, seen=seen)
                checked += 1
                done += read[0]
                status = "ok" if not bad else f"FAILED ({len(bad)} bad file(s))"
                blobs = ""
                if manifest.blobs:
                    again = len(manifest.blobs) - (len(seen) - before)
                    blobs = f" + {len(manifest.blobs)} shared blobs"
                    blobs += f" ({again} checked before)" if again else ""
                say(
                    bar,
                    f"step {step}: {len(manifest.files)} files{blobs}, "
                    f"{size_text(read[0])} read: {status}",
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
    print(f"verified {checked} checkpoint(s), {size_text(done)} read: all sizes and CRC32C match")
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
    from checkpointd.removal import finish_removals

    policy = _policy(args)
    with _open(args) as store:
        plan = plan_gc(store, policy, older_than=args.older_than)
        print(f"retention ({_rules(policy)}):")
        for info in plan.checkpoints:
            if info.step in plan.retention.reasons:
                reasons = ", ".join(plan.retention.reasons[info.step])
                print(f"  keep    step {info.step:>10}  ({reasons})")
            else:
                print(
                    f"  delete  step {info.step:>10}  frees {size_text(plan.step_frees(info.step))}"
                )
        if plan.shared_frees:
            print(
                f"  delete  shared blobs only deleted steps use  frees "
                f"{size_text(plan.shared_frees)}"
            )
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
    removals = finish_removals(args.root, storage_options(args), apply=args.apply)
    if removals:
        print("roots whose removal a crash cut short (the Lightning plugin's):")
        print("\n".join(removals))
    verb = "deleted" if args.apply else "would delete"
    print(
        f"{verb} {len(plan.retention.delete)} checkpoint(s) and {len(plan.leftovers)} "
        f"leftover(s), {'freed' if args.apply else 'would free'} {size_text(plan.freed)}"
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


_HANDLERS: dict[str, Command] = {
    "demo": _cmd_demo,
    "ls": _cmd_ls,
    "inspect": _cmd_inspect,
    "verify": _cmd_verify,
    "gc": _cmd_gc,
    "export": _cmd_export,
    "import": _cmd_import,
    "serve": cli_service.cmd_serve,
    "status": cli_service.cmd_status,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return the exit status."""
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
