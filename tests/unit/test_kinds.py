"""The kinds a test is marked with (tests/support/kinds.py) come from what it reaches."""

from __future__ import annotations

import pytest

from tests.support.kinds import KINDS, _Scan


def _reached(func: object) -> frozenset[str]:
    names, _ = _Scan().reach(func)  # type: ignore[arg-type]
    return names


def test_ranks_started_through_a_context_manager_helper_are_reached() -> None:
    from tests.faults import test_rank_stalls

    names = _reached(
        test_rank_stalls.test_a_stalled_publisher_resumes_to_the_outcome_the_others_decided
    )
    assert "tests.support.launch.start_ranks" in names


def test_a_service_started_by_a_helper_imported_inside_the_test_is_reached() -> None:
    from tests.integration import test_service_layout

    names = _reached(
        test_service_layout.test_the_trainers_shard_block_and_index_threshold_through_the_services
    )
    assert "tests.support.service.services_per_rank" in names or (
        "tests.support.service.start_service" in names
    )
    assert "tests.support.launch.run_ranks" in names  # through test_sharded.job


def test_a_pure_unit_test_reaches_no_process_or_emulator() -> None:
    from tests.unit import test_format

    names = _reached(test_format.test_header_round_trips_and_aligns_data_to_8_bytes)
    assert not {n for n in names if n.startswith("tests.support.")}


def test_this_session_marked_the_tests_here(request: pytest.FixtureRequest) -> None:
    marked = {m.name for m in request.node.iter_markers()}
    assert not marked & set(KINDS)
