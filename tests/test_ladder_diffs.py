"""The ladder's promise: each script is the one before it plus one distributed
concept, so ``diff -u`` of two neighbours stays short enough to read as that
rung's lesson. Budgets are changed lines (added + removed) as ``diff -u``
counts them; each script's docstring names the rung it adds over.
"""

import re
import subprocess

import pytest

from helpers import REPO

# (script, the rung before it, most changed lines): the sizes the diffs measure, so that a
# rung grows only by a deliberate change of its budget here.
LADDER = [
    ("multigpu_spawn.py", "singlegpu.py", 86),
    ("multigpu_torchrun.py", "multigpu_spawn.py", 72),
    ("multinode.py", "multigpu_torchrun.py", 28),
    ("multinode_fsdp.py", "multinode.py", 102),
]


def changed_lines(before: str, after: str) -> int:
    """Lines added plus lines removed in ``diff -u before after``, as a reader runs it."""
    diff = subprocess.run(["diff", "-u", before, after], cwd=REPO, capture_output=True, text=True)
    assert diff.returncode in (0, 1), diff.stderr  # 1: the files differ
    return sum(1 for line in diff.stdout.splitlines()[2:] if line[:1] in "+-")


@pytest.mark.parametrize("script, before, budget", LADDER, ids=[s for s, _, _ in LADDER])
def test_each_rung_differs_from_the_one_before_by_at_most_its_budget(script, before, budget):
    changed = changed_lines(before, script)
    assert changed <= budget, f"diff -u {before} {script}: {changed} changed lines, over the budget of {budget}"


@pytest.mark.parametrize("script, before, budget", LADDER, ids=[s for s, _, _ in LADDER])
def test_each_docstring_says_what_it_adds_over_the_rung_before(script, before, budget):
    docstring = (REPO / script).read_text().split('"""')[1]
    assert re.search(rf"^Adds over {re.escape(before)}:", docstring, re.M), \
        f"{script}'s docstring should say 'Adds over {before}:'"
