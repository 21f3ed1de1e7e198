"""benchmarks.compare: every row of the suite before and after, from one command (not timed)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks import compare


def test_rows_name_each_series_by_its_median_and_each_ratio_by_its_label() -> None:
    result = {
        "model": {
            "nbytes": 10,
            "series": {"save": {"median": 2.0, "min": 1.0, "max": 3.0, "values": [1, 2, 3]}},
            "ratios": [{"label": "save / floor", "value": 1.5, "goal": 2.0}],
        },
        "machine": {"cpus": 2},
        "raw": [{"copy": 9.0}],
        "slowdown": 0.25,
    }
    assert dict(compare.rows("large", result)) == {
        "large/model/save": 2.0,
        "large/model/ratios/save / floor": 1.5,
        "large/slowdown": 0.25,
    }


def test_the_table_gives_after_over_before_and_marks_a_side_that_lacks_a_row() -> None:
    figures = {"a": {"before": [2.0, 4.0], "after": [1.5]}, "new": {"before": [], "after": [1.0]}}
    assert compare.table(figures) == [
        {"row": "a", "before": 3.0, "after": 1.5, "after/before": 0.5},
        {"row": "new", "before": None, "after": 1.0, "after/before": None},
    ]


@pytest.mark.timeout(180)
def test_one_section_runs_on_both_sides_and_the_table_holds_its_rows(tmp_path: Path) -> None:
    if shutil.which("git") is None or not (compare.REPO / ".git").exists():
        pytest.skip("benchmarks.compare reads the old source from this repository's git history")
    head = subprocess.run(
        ["git", "-C", str(compare.REPO), "rev-parse", "HEAD"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    out = tmp_path / "table.json"
    argv = ["--before", head, "--mode", "smoke", "--only", "large", "--dir", str(tmp_path)]
    assert compare.main([*argv, "--out", str(out)]) == 0
    table = json.loads(out.read_text())
    assert table["before"] == head
    rows = {row["row"]: row for row in table["rows"]}
    durable = rows["large/model (smoke)/checkpointd.durable"]
    assert min(durable["before"], durable["after"], durable["after/before"]) > 0
    assert "large/model (smoke)/ratios/checkpointd blocked / memcpy floor" in rows
