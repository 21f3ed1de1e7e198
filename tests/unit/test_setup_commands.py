"""The README's two set-up commands and CI run the same install and the same tests."""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]


def _readme_setup_commands() -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Set-up: two commands", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_readme_has_two_commands_and_ci_runs_both() -> None:
    install, tests = _readme_setup_commands()
    ci = (REPO / ".ci" / "run").read_text()
    install_script = install.split(" && ")[0]
    assert re.search(rf"^{re.escape(install_script)}$", ci, re.MULTILINE), install_script
    assert re.search(rf"^{re.escape(tests)}$", ci, re.MULTILINE), tests
    assert install.endswith("checkpointd demo")


def test_command_one_installs_what_the_tests_import() -> None:
    """torchtitan and the packages its tests need come with command 1, so that command 2
    runs the torchtitan tests instead of skipping them; the npm emulators too."""
    install_script = _readme_setup_commands()[0].split(" && ")[0]
    script = (REPO / install_script).read_text()
    for needed in (
        "torch==2.13.0",
        "'.[test,docs]'",
        "torchtitan==",
        "tyro==",
        "torchdata==",
        "s3rver@",
        "azurite@",
    ):
        assert needed in script, needed
    assert script.index("torch==2.13.0") < script.index("'.[test,docs]'"), "torch first, pinned"
