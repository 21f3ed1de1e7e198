"""The commands that look after a root: ``verify`` and ``gc``.

``verify`` reads every byte against its CRC32C; ``gc`` shows retention and leftovers,
and deletes them with ``--apply``. Parse, call the library, print.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, Literal

from checkpointd.cli.output import progress_bar, say, size_text
from checkpointd.cli.parser import open_root, storage_options
from checkpointd.errors import CheckpointError, CheckpointNotFoundError

if TYPE_CHECKING:
    from checkpointd.maintain.gc import GcPlan
    from checkpointd.maintain.retention import RetentionPolicy
    from checkpointd.storage import Store

__all__ = ["cmd_gc", "cmd_verify"]


# ---------------------------------------------------------------------------
# verify


def _verify_targets(store: Store, args: argparse.Namespace) -> tuple[list[Any], list[str]]:
    """The (step, manifest) pairs to verify, and the manifests that failed to read."""
    from checkpointd.read import catalog

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


def cmd_verify(args: argparse.Namespace) -> int:
    """``checkpointd verify ROOT``: read every byte of each step against its manifest.

    Args:
        args: The parsed command line (cli/parser.py).

    Returns:
        The exit status: 0 if all match, 1 if a file fails (the first failure on stderr).
    """
    from checkpointd.read.verify import verify_step

    checked = done = 0  # done: bytes read (a shared blob once, however many steps use it)
    seen: dict[tuple[str, int], str | None] = {}  # a shared blob is read once
    with open_root(args) as store:
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
    from checkpointd.maintain.retention import RetentionPolicy

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


def cmd_gc(args: argparse.Namespace) -> int:
    """``checkpointd gc ROOT``: what retention and leftovers would delete; ``--apply`` deletes.

    Args:
        args: The parsed command line (cli/parser.py).

    Returns:
        The exit status: 0; 1 if retention refused to delete because no checkpoint checks out.
    """
    from checkpointd.maintain.gc import apply_gc, plan_gc
    from checkpointd.maintain.removal import finish_removals

    policy = _policy(args)
    with open_root(args) as store:
        plan = plan_gc(store, policy, older_than=args.older_than)
        print(f"retention ({_rules(policy)}):")
        for info in plan.checkpoints:
            if info.step in plan.retention.reasons:
                reasons = ", ".join(plan.retention.reasons[info.step])
                checked = "  verified" if info.step in plan.verified else ""
                print(f"  keep    step {info.step:>10}  ({reasons}){checked}")
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
        _report_damage(plan)
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
    return 1 if plan.refused else 0


def _report_damage(plan: GcPlan) -> None:
    """On stderr: each counted step that failed verification, and what is kept instead."""
    for step, problem in sorted(plan.damaged.items()):
        print(
            f"checkpointd gc: step {step} fails verification ({problem}): kept, but it "
            "counts for no retention rule",
            file=sys.stderr,
        )
    if plan.refused:
        print(
            "checkpointd gc: no checkpoint that retention counts verifies: deleting no "
            "checkpoint (see checkpointd verify ROOT --all)",
            file=sys.stderr,
        )
    elif plan.damaged:
        sound = [s for s in plan.retention.reasons if s not in plan.damaged]
        instead = f"keeping step {max(sound)} in its place" if sound else "keeping the others"
        checked = " (verified)" if sound and max(sound) in plan.verified else ""
        print(f"checkpointd gc: {instead}{checked}", file=sys.stderr)
