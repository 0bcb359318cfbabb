"""Every command in the README and in docs/ runs as written.

Each ```bash block of README.md and docs/*.md runs as one bash script
(``set -euo pipefail``) in a fresh folder holding the project's scripts and
the custom-task guide's my_task.py, with the test environment's python and
torchrun first on PATH and DATA_DIR pointing at real MNIST digits, so that
`--dataset mnist` works offline. Blocks that need what a test machine is not
(a Slurm submission, a container engine, a fresh install) are named with the
test that covers them instead. Output shown in ```text blocks is not run.

Every block runs in a walk through README.md and then the pages in
reading order, all in one folder, as a newcomer runs them, so that what one
block leaves behind (snapshots, metrics files) meets the next. The rungs'
blocks run the ladder; every kit feature's block runs train.py.

The pages also speak to users (no issue numbers, no remarks about the
machines the project was built on) and their links lead to a file and a
heading that exist.
"""

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from helpers import REPO, TORCHRUN, script_env
from test_custom_task import guide_task_module
from test_readme import check_shown_output

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# First words of commands this test does not run, and where they are tested instead.
COVERED_ELSEWHERE = {
    "sbatch": "tests/test_slurm.py submits the wrappers to a real Slurm cluster",
    "python3 -m venv": "the README's set-up: .ci/run runs command 2 verbatim (tests/test_readme.py)",
    "podman": "tests/test_container.py builds and runs the image with podman",
    "torchrun --nnodes=1:2 ":
        "an elastic job of several nodes: tests/test_elastic.py runs two agents, one lost and started again",
    "docker": "tests/test_container.py runs the same image with podman (no Docker engine here)",
    "apptainer": "not installable on these machines; see docs/containers.md",
    ".venv/bin/pip install -q -r requirements.txt -r requirements-test.txt && .venv/bin/python benchmarks/run.py":
        "the benchmark prints figures (docs/performance.md) and is not part of the test run",
}


def bash_blocks() -> list:
    """(doc name, block number, block text) of every ```bash block."""
    found = []
    for doc in DOCS:
        for number, block in enumerate(re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S)):
            found.append((doc.relative_to(REPO).as_posix(), number, block))
    return found


def commands(block: str) -> list:
    """The block's commands: continuation lines joined, comments dropped."""
    joined = block.replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in joined.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def covered_elsewhere(block: str):
    if "--dataset cifar10" in block:
        return ("tests/test_recipes.py runs docs/recipes.md's --dataset cifar10 commands as written on "
                "CIFAR-10-shaped files (CIFAR-10 cannot be downloaded here)")
    if "--dataset shakespeare_char" in block:
        return ("the language-model recipes train for minutes to hours; tests/test_language_model.py trains "
                "the GPT with the task's recipe in train.py and in a rung on a slice of the corpus")
    for command in commands(block):
        command = re.sub(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)+", "", command)  # VAR=value sbatch ...
        for start, reason in COVERED_ELSEWHERE.items():
            if command.startswith(start):
                return reason
    return None


@pytest.fixture(scope="module")
def docs_data(tmp_path_factory):
    from dataset_files import build_mnist_root

    # What $DATA_DIR holds for the pages' MNIST commands: real digits, few (the
    # commands must run as written; what the recipe reaches is in docs/recipes.md's table).
    return build_mnist_root(tmp_path_factory.mktemp("docs_mnist"), n_train=600, n_test=100)


@pytest.mark.parametrize("doc,number,block", bash_blocks(),
                         ids=[f"{doc}#{number}" for doc, number, _ in bash_blocks()])
def test_documented_commands_run_as_written(doc, number, block):
    """Each block either runs in the one-folder walk below (and holds no
    placeholder a reader would have to replace: those belong in ```text), or
    names the test that runs it elsewhere, and what it submits exists."""
    reason = covered_elsewhere(block)
    if reason:
        # Still check what such a block names exists: the wrappers it submits.
        for wrapper in re.findall(r"slurm/\S+\.sh", block):
            assert (REPO / wrapper).is_file(), wrapper
            assert wrapper.split("/")[1] in (REPO / "tests" / "test_slurm.py").read_text()
        pytest.skip(f"not run here: {reason}")
    assert not re.search(r"\b[A-Z][A-Z_]*_HOST\b|\bJOB_ID\b", block), "placeholders belong in ```text"


# What user-facing pages do not say: the project's history and its test
# machines belong in commit messages and results tables, not in running text.
NOT_FOR_USERS = [
    r"\bissues? #\d+", r"\(issue\b", r"\buntested (?:here|there)\b",
    r"\bnot (?:run|tried|measured|tested|reproduced) here\b", r"\bno GPU was (?:lent|available)\b",
    r"\bthe session\b", r"\bhere \(\d+ (?:CPU |shared )?cores", r"\b\d+ min \d+ s here\b",
    r"\b(?:seen|measured|found|run|ran) here\b", r"\bon this machine\b", r"\bthis (?:VM|work)\b",
    r"\b(?:an earlier version of this page|before this work)\b",
]


def test_user_pages_speak_to_users():
    """README.md and docs/*.md carry no issue numbers, no "untested here", no
    remarks about the machines or sessions the project was built on: measured
    figures go in results tables that name the machine and torch version."""
    found = [f"{doc.relative_to(REPO)}: {match.group(0)!r}"
             for doc in DOCS for pattern in NOT_FOR_USERS
             for match in re.finditer(pattern, doc.read_text(), re.I)]
    assert not found, "\n".join(found)


def test_the_phrase_check_can_fail():
    assert any(re.search(p, "fixed in (issue #24), untested here", re.I) for p in NOT_FOR_USERS)
    assert not any(re.search(p, "torchrun restarts every rank here", re.I) for p in NOT_FOR_USERS)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_pages_lead_somewhere():
    """Every relative link of README.md and docs/*.md names a file that exists
    and, with a #fragment, a heading of that file."""
    broken = []
    for doc in DOCS:
        for target, fragment in re.findall(r"\]\(([\w./-]*\.md)(?:#([\w-]+))?\)", doc.read_text()):
            path = (doc.parent / target).resolve()
            if not path.is_file():
                broken.append(f"{doc.relative_to(REPO)}: {target}")
            elif fragment and fragment not in {_anchor(h) for h in
                                                re.findall(r"^#+ (.*)$", path.read_text(), re.M)}:
                broken.append(f"{doc.relative_to(REPO)}: {target}#{fragment}")
    assert not broken, broken


def _workspace(folder, data_dir) -> dict:
    """Make ``folder`` a user's checkout as the docs assume it (the scripts, the
    task modules, train_utils, the guide's my_task.py); return the environment
    of a shell with the test environment activated and DATA_DIR set."""
    for script in REPO.glob("*.py"):  # the scripts and the task modules
        shutil.copy(script, folder)
    shutil.copytree(REPO / "train_utils", folder / "train_utils",
                    ignore=shutil.ignore_patterns("__pycache__"))
    guide_task_module(folder)
    bin_dir = folder / "bin"  # `python` and `torchrun` as a user's activated environment has them
    bin_dir.mkdir()
    for name, command in (("python", [sys.executable]), ("torchrun", TORCHRUN)):
        (bin_dir / name).write_text(f"#!/bin/sh\nexec {' '.join(map(str, command))} \"$@\"\n")
        (bin_dir / name).chmod(0o755)
    return script_env(DATA_DIR=str(data_dir), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def _run_block(doc: str, number: int, block: str, folder, env: dict) -> str:
    """Run one ```bash block as a script (set -euo pipefail) in ``folder``;
    assert it exits 0 without a traceback; return its stdout."""
    start = time.monotonic()
    result = subprocess.run(["bash", "-c", "set -euo pipefail\n" + block], cwd=folder, env=env,
                            capture_output=True, text=True, timeout=600)
    print(f"{doc} block {number}: {time.monotonic() - start:.1f} s")
    assert result.returncode == 0, (f"{doc} block {number}:\n{block}\n--- stdout\n{result.stdout[-3000:]}"
                                    f"\n--- stderr\n{result.stderr[-3000:]}")
    assert "Traceback" not in result.stderr, f"{doc} block {number}:\n{result.stderr[-3000:]}"
    return result.stdout


def reading_order() -> list:
    """README.md, then the docs pages in the order the README first links them
    (a page it does not link comes last)."""
    readme = (REPO / "README.md").read_text()
    linked = list(dict.fromkeys(re.findall(r"\]\((docs/[\w-]+\.md)\)", readme)))
    pages = [doc.relative_to(REPO).as_posix() for doc in DOCS[1:]]
    return ["README.md"] + sorted(pages, key=lambda page: linked.index(page) if page in linked else len(linked))


def _shared_beside(folder) -> None:
    """The project's shared data beside ``folder`` as beside a checkout:
    ``../shared/data/mnist-t10k`` (docs/recipes.md stages MNIST from it)."""
    from dataset_files import require_mnist_t10k

    (folder.parent / "shared" / "data").mkdir(parents=True)
    (folder.parent / "shared" / "data" / "mnist-t10k").symlink_to(require_mnist_t10k())


def test_a_newcomer_runs_the_readme_then_every_page_in_one_folder(docs_data, tmp_path):
    """As a newcomer does: the README's commands, then each page's, in reading
    order, all in the same folder, so that what one block leaves behind
    (snapshots, checkpoints, metrics files, curves) meets the next. The blocks
    run elsewhere (Slurm, containers, a fresh install) are left out here too.
    The output the README shows for its Step 1 and its train.py resume, and
    docs/custom-task.md's train.py outputs, are compared with what their
    blocks print here (tests/test_readme.py's check_shown_output)."""
    folder = tmp_path / "project"
    folder.mkdir()
    _shared_beside(folder)
    env = _workspace(folder, docs_data)
    blocks = bash_blocks()
    for page in reading_order():
        for doc, number, block in blocks:
            if doc == page and not covered_elsewhere(block):
                stdout = _run_block(doc, number, block, folder, env)
                check_shown_output(block, stdout, doc)
