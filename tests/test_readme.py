"""The README's two set-up commands are what users and CI run: keep them true."""

import re

from helpers import REPO


def _readme_commands():
    block = re.search(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_readme_opens_with_the_two_commands():
    run_job, run_tests = _readme_commands()
    assert run_job.endswith(".venv/bin/python singlegpu.py")
    assert run_tests.endswith("-m pytest -v tests")


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (REPO / ".ci" / "run").read_text()
    assert _readme_commands()[1] in ci.splitlines()
    assert "set -euo pipefail" in ci
