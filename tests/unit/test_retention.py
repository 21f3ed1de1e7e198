"""Retention policies as pure functions: examples, then properties over random histories."""

from __future__ import annotations

import math
import warnings
from datetime import UTC, datetime
from typing import Any, Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointd import tunables
from checkpointd.format.manifest import CheckpointInfo
from checkpointd.maintain.retention import (
    RetentionPolicy,
    WriterIdentity,
    plan_retention,
)


def ckpt(step: int, **metrics: Any) -> CheckpointInfo:
    return CheckpointInfo(
        step=step,
        path=f"root/{step:012d}",
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        nbytes=100,
        metrics=metrics,
        metadata={},
        components=("model",),
    )


def steps(infos: list[CheckpointInfo]) -> list[int]:
    return [c.step for c in infos]


HISTORY = [ckpt(s, loss=1.0 / s) for s in (10, 20, 30, 40, 50, 60)]


# --- validation -------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"keep_last": 0},
        {"keep_last": -1},
        {"keep_every": 0},
        {"keep_last": True},
        {"keep_last": 2.0},
        {"keep_best": 2},  # no best_metric
        {"keep_best": 2, "best_metric": "loss", "best_mode": "lowest"},
    ],
)
def test_invalid_policies_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"keep_|best_"):
        RetentionPolicy(**kwargs)


# --- examples ---------------------------------------------------------------


def test_no_rule_keeps_everything() -> None:
    assert plan_retention(HISTORY, RetentionPolicy()).delete == ()
    assert plan_retention(HISTORY, RetentionPolicy()).keep == set(steps(HISTORY))


def test_empty_history() -> None:
    plan = plan_retention([], RetentionPolicy(keep_last=1))
    assert plan.keep == set()
    assert plan.delete == ()


def test_keep_last_keeps_the_newest_n_by_step_in_any_input_order() -> None:
    shuffled = [HISTORY[i] for i in (3, 0, 5, 1, 4, 2)]
    assert steps(list(plan_retention(shuffled, RetentionPolicy(keep_last=2)).delete)) == [
        10,
        20,
        30,
        40,
    ]


def test_keep_every_keeps_multiples_and_the_newest() -> None:
    kept = plan_retention(HISTORY, RetentionPolicy(keep_every=25)).keep
    assert kept == {50, 60}  # 50 divisible by 25; 60 is the newest


@pytest.mark.parametrize(("mode", "expected"), [("min", {50, 60}), ("max", {10, 20, 60})])
def test_keep_best_by_mode(mode: Literal["min", "max"], expected: set[int]) -> None:
    # loss = 1/step: the lowest losses are the newest steps.
    policy = RetentionPolicy(keep_best=2, best_metric="loss", best_mode=mode)
    assert plan_retention(HISTORY, policy).keep == expected


def test_rules_combine_as_a_union_with_reasons() -> None:
    history = [ckpt(s, acc=a) for s, a in [(1, 0.9), (2, 0.1), (3, 0.2), (4, 0.3), (5, 0.4)]]
    policy = RetentionPolicy(
        keep_last=1, keep_every=2, keep_best=1, best_metric="acc", best_mode="max"
    )
    plan = plan_retention(history, policy)
    assert plan.reasons == {
        1: ("best",),
        2: ("every",),
        4: ("every",),
        5: ("newest", "last"),
    }
    assert steps(list(plan.delete)) == [3]


def test_ties_in_the_best_metric_go_to_the_newer_step() -> None:
    history = [ckpt(s, loss=0.5) for s in (1, 2, 3)] + [ckpt(4, loss=0.9)]
    policy = RetentionPolicy(keep_best=1, best_metric="loss")
    assert plan_retention(history, policy).keep == {3, 4}


def test_protected_steps_are_kept_and_others_are_not_invented() -> None:
    plan = plan_retention(HISTORY, RetentionPolicy(keep_last=1), protect=(20, 999))
    assert plan.keep == {20, 60}
    assert plan.reasons[20] == ("protected",)


def test_another_writers_checkpoint_is_kept_only_within_the_grace_window() -> None:
    committed_at = 1_000_000.0
    foreign = {20: committed_at, 40: committed_at - 10_000}  # 40 was committed long ago
    policy = RetentionPolicy(keep_last=1)
    inside = plan_retention(HISTORY, policy, foreign=foreign, now=committed_at + 599, grace=600)
    assert inside.keep == {20, 60}
    assert inside.reasons[20] == ("other writer",)
    after = plan_retention(HISTORY, policy, foreign=foreign, now=committed_at + 601, grace=600)
    assert after.keep == {60}
    # A step the rules keep anyway just gains the reason; nothing is invented.
    both = plan_retention(HISTORY, policy, foreign={60: committed_at, 999: 0.0}, now=committed_at)
    assert both.reasons[60] == ("newest", "last", "other writer")
    assert both.keep == {60}


def test_grace_is_ten_minutes_or_twice_the_writers_save_interval() -> None:
    identity = WriterIdentity()
    assert identity.id != WriterIdentity().id
    assert identity.grace() == tunables.GRACE_SECONDS == 600.0
    identity.note_commit(1_000.0)
    assert identity.grace() == tunables.GRACE_SECONDS
    identity.note_commit(1_000.0 + 2_000)
    assert identity.grace() == 4_000
    identity.note_commit(3_000.0 + 10)
    assert identity.grace() == tunables.GRACE_SECONDS


@pytest.mark.parametrize("missing", [None, "n/a", True, math.nan])
def test_checkpoint_without_a_usable_metric_is_kept_only_by_other_rules(missing: Any) -> None:
    metrics = {} if missing is None else {"loss": missing}
    history = [ckpt(1, loss=0.1), ckpt(2, **metrics), ckpt(3, loss=0.3), ckpt(4, loss=0.4)]
    policy = RetentionPolicy(keep_best=1, best_metric="loss", keep_every=2)
    plan = plan_retention(history, policy)
    assert plan.unranked == (2,)
    assert plan.reasons[2] == ("every",)  # kept by keep_every, not ranked by keep_best
    assert plan.keep == {1, 2, 4}
    # Without another rule to keep it, it goes (the writer warns: test_retention_writer).
    lone = RetentionPolicy(keep_best=1, best_metric="loss")
    assert 2 in steps(list(plan_retention(history, lone).delete))


def test_plan_itself_never_warns() -> None:
    history = [ckpt(1), ckpt(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan_retention(history, RetentionPolicy(keep_best=1, best_metric="loss"))


# --- properties -------------------------------------------------------------

metric_values = st.one_of(
    st.none(), st.floats(allow_nan=True, allow_infinity=False, width=32), st.integers(-5, 5)
)


@st.composite
def histories(draw: st.DrawFn) -> list[CheckpointInfo]:
    chosen = draw(st.lists(st.integers(0, 400), unique=True, max_size=25))
    result = []
    for step in chosen:
        value = draw(metric_values)
        result.append(ckpt(step) if value is None else ckpt(step, m=value))
    return result


policies = st.builds(
    RetentionPolicy,
    keep_last=st.none() | st.integers(1, 8),
    keep_every=st.none() | st.integers(1, 60),
    keep_best=st.none() | st.integers(1, 6),
    best_metric=st.just("m"),
    best_mode=st.sampled_from(["min", "max"]),
)


def _rankable(c: CheckpointInfo) -> bool:
    value = c.metrics.get("m")
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


def _better(a: CheckpointInfo, b: CheckpointInfo, mode: str) -> bool:
    """a ranks strictly before b: a better value, or the same value and a newer step."""
    va, vb = a.metrics["m"], b.metrics["m"]
    if va != vb:
        return bool(va < vb) if mode == "min" else bool(va > vb)
    return a.step > b.step


def rule_picks(history: list[CheckpointInfo], policy: RetentionPolicy) -> set[int]:
    """What the rules keep, computed independently of the implementation."""
    by_step = sorted(c.step for c in history)
    picks: set[int] = set(by_step[-1:])
    if policy.keep_last:
        picks.update(by_step[max(0, len(by_step) - policy.keep_last) :])
    if policy.keep_every:
        picks.update(s for s in by_step if s % policy.keep_every == 0)
    if policy.keep_best:
        ranked = [c for c in history if _rankable(c)]
        for c in ranked:
            better = sum(_better(o, c, policy.best_mode) for o in ranked if o is not c)
            if better < policy.keep_best:
                picks.add(c.step)
    if not policy.deletes_anything:
        picks.update(by_step)
    return picks


@settings(max_examples=150, deadline=None)
@given(histories(), policies, st.lists(st.integers(0, 400), max_size=3))
def test_plan_keeps_exactly_the_rule_picks(
    history: list[CheckpointInfo], policy: RetentionPolicy, protect: list[int]
) -> None:
    plan = plan_retention(history, policy, protect=protect)
    all_steps = {c.step for c in history}
    if history:
        assert max(all_steps) in plan.keep  # the newest is always kept
    expected = rule_picks(history, policy) | (all_steps & set(protect))
    assert plan.keep == expected  # every pick kept, and nothing outside the rules
    assert {c.step for c in plan.delete} == all_steps - plan.keep
    assert steps(list(plan.delete)) == sorted(steps(list(plan.delete)))
    if policy.keep_best is None:
        assert plan.unranked == ()
    else:
        assert set(plan.unranked) == {c.step for c in history if not _rankable(c)}


@settings(max_examples=100, deadline=None)
@given(histories(), policies)
def test_applying_a_plan_twice_deletes_nothing_more(
    history: list[CheckpointInfo], policy: RetentionPolicy
) -> None:
    """A retention pass interrupted and rerun converges to the same survivors."""
    plan = plan_retention(history, policy)
    survivors = [c for c in history if c.step in plan.keep]
    assert plan_retention(survivors, policy).delete == ()


@settings(max_examples=100, deadline=None)
@given(histories(), policies, st.integers(401, 500))
def test_a_newer_commit_only_ever_deletes_older_checkpoints(
    history: list[CheckpointInfo], policy: RetentionPolicy, new_step: int
) -> None:
    """Retention run after committing a newer step keeps that step whatever its metric."""
    plan = plan_retention([*history, ckpt(new_step, m=1e9)], policy)
    assert new_step in plan.keep


# --- damaged steps count for no rule ---------------------------------------------


def test_a_damaged_newest_step_is_kept_but_an_older_sound_one_counts_instead() -> None:
    plan = plan_retention(HISTORY, RetentionPolicy(keep_last=2), damaged=[60])
    assert plan.reasons == {40: ("last",), 50: ("newest", "last"), 60: ("damaged",)}
    assert steps(list(plan.delete)) == [10, 20, 30]


def test_keep_best_ranks_only_sound_steps_and_a_damaged_victim_still_goes() -> None:
    policy = RetentionPolicy(keep_best=1, best_metric="loss")  # lowest loss: the newest
    plan = plan_retention(HISTORY, policy, damaged=[60, 20])
    assert plan.reasons == {50: ("newest", "best"), 60: ("damaged",)}
    assert steps(list(plan.delete)) == [10, 20, 30, 40]  # 20: damaged, kept by no rule


def test_damage_never_deletes_what_the_plan_without_it_keeps() -> None:
    policy = RetentionPolicy(keep_last=1, keep_every=20)
    whole = plan_retention(HISTORY, policy)
    for bad in ([60], [40, 60], [10, 20, 30, 40, 50, 60]):
        plan = plan_retention(HISTORY, policy, damaged=bad)
        assert whole.keep <= plan.keep
        assert {v.step for v in plan.delete} <= {v.step for v in whole.delete}


def _checked(bad: set[int], every: bool, first: int | None = None) -> tuple[Any, list[int]]:
    from checkpointd.maintain.soundness import checked_plan

    asked: list[int] = []

    def check(step: int) -> str | None:
        asked.append(step)
        return "bad" if step in bad else None

    policy = RetentionPolicy(keep_last=2)
    planner = lambda damaged: plan_retention(HISTORY, policy, damaged=damaged)  # noqa: E731
    return checked_plan(planner, check, every=every, first=first), asked


def test_gc_checks_every_counted_step_and_replaces_each_damaged_one() -> None:
    checked, asked = _checked({60, 40}, every=True)
    assert asked == [60, 50, 40, 30]  # newest first; each failure pulls an older one in
    assert checked.damaged == {60: "bad", 40: "bad"}
    assert checked.sound == (50, 30)
    assert checked.plan.keep == {30, 50, 60}  # 60 damaged but newest; 40 damaged, kept by none
    assert steps(list(checked.plan.delete)) == [10, 20, 40]


def test_a_writer_checks_its_commit_and_reads_further_only_if_it_fails() -> None:
    checked, asked = _checked(set(), every=False, first=60)
    assert asked == [60]
    assert steps(list(checked.plan.delete)) == [10, 20, 30, 40]
    checked, asked = _checked({60}, every=False, first=60)
    assert asked == [60, 50]  # 40 is kept unread: the root keeps 50, which checked out
    assert steps(list(checked.plan.delete)) == [10, 20, 30]


def test_nothing_is_deleted_when_no_counted_step_checks_out() -> None:
    checked, _ = _checked({10, 20, 30, 40, 50, 60}, every=True)
    assert checked.refused
    assert checked.plan.delete == ()
    assert checked.plan.keep == {10, 20, 30, 40, 50, 60}
