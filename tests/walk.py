"""The newcomer's walk: every ```bash block of README.md and docs/*.md run as
written, as a newcomer runs them, in reading order (README.md, then the pages
in the order the README first links them), all in one folder, so that what
one block leaves behind (snapshots, checkpoints, metrics files) meets the
next. The folder holds the project's scripts and the custom-task guide's
task files, the test environment's ``python`` and ``torchrun`` come first on
PATH, DATA_DIR points at real MNIST digits (so `--dataset mnist` works
offline), and ../shared beside it holds the real MNIST test split. Blocks
that need what a test machine is not (a Slurm submission, a container
engine, a fresh install) are left out, each naming the test that covers it.

The walk is made once per test session (``conftest.newcomer_walk``) and
several tests read it: tests/test_docs.py checks that every block ran,
tests/test_ladder.py what each rung's README step printed and saved, others
what the kit's blocks did. Each block's outcome is kept (``Block``), and so is
what it saved (``Walk.saved``): the next blocks may resume from, or replace,
the same files. The walk goes as far as a test needs (``Walk.through``) and
stops at the first block that fails; tests that need a later block then fail
naming it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from support.runs import REPO, TORCHRUN, script_env

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# First words of commands the walk does not run, and where they are tested instead.
COVERED_ELSEWHERE = {
    "sbatch": "tests/test_slurm.py submits the wrappers to a real Slurm cluster",
    "python3 -m venv": "the README's set-up: .ci/run runs command 2 verbatim (tests/test_readme.py)",
    "podman": "tests/test_container.py builds and runs the image with podman",
    "torchrun --nnodes=1:2 ":
        "an elastic job of several nodes: tests/test_elastic.py runs two agents, one lost and started again",
    "docker": "tests/test_container.py runs the same image with podman (no Docker engine here)",
    "apptainer": "not installable on these machines; see docs/containers.md",
    "python tools/export_hf.py": "tests/test_init_from.py exports a run's snapshot and loads it with transformers",
    ".venv/bin/pip install -q -r requirements.txt -r requirements-test.txt && .venv/bin/python benchmarks/run.py":
        "the benchmark prints figures (docs/performance.md) and is not part of the test run",
}
# What a walk keeps of each block's changes to its folder (``Walk.saved``): every file or
# folder at the top that the block made or changed, but the larger ones (data it staged).
KEEP_AT_MOST_BYTES = 20 * 2**20
NOT_KEPT = ("__pycache__",)  # Python's bytecode of the folder's modules
BLOCK_TIMEOUT_S = 600


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


def covered_elsewhere(block: str) -> Optional[str]:
    """Why the walk does not run ``block``, naming the test that does; None when it runs it."""
    if "--init_from" in block:
        return ("--init_from starts from weights trained elsewhere (GPT-2's come from the Hugging Face Hub); "
                "tests/test_init_from.py starts runs from a GPT-2 trained there, a kit snapshot and a ckpt.pt")
    if "--dataset cifar10" in block:
        return ("tests/test_recipes.py runs docs/recipes.md's --dataset cifar10 commands as written on "
                "CIFAR-10-shaped files (CIFAR-10 cannot be downloaded here)")
    if "--dataset tokens" in block and not block.lstrip().startswith("sbatch"):
        return ("--dataset tokens needs nanoGPT's token files and trains for minutes to days; "
                "tests/test_token_files.py trains it on Tiny Shakespeare's shakespeare_char files")
    if "--dataset shakespeare_char" in block:
        return ("the language-model recipes train for minutes to hours; tests/test_language_model.py trains "
                "the GPT with the task's recipe in train.py and in a rung on a slice of the corpus")
    if "s3://" in block:
        return ("snapshots in a bucket need an S3 store and boto3: tests/test_s3_snapshots.py runs train.py with "
                "s3:// snapshots against moto's S3 server on 127.0.0.1")
    for command in commands(block):
        command = re.sub(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)+", "", command)  # VAR=value sbatch ...
        for start, reason in COVERED_ELSEWHERE.items():
            if command.startswith(start):
                return reason
    return None


def reading_order() -> list:
    """README.md, then the docs pages in the order the README first links them
    (a page it does not link comes last)."""
    readme = (REPO / "README.md").read_text()
    linked = list(dict.fromkeys(re.findall(r"\]\((docs/[\w-]+\.md)\)", readme)))
    pages = [doc.relative_to(REPO).as_posix() for doc in DOCS[1:]]
    return ["README.md"] + sorted(pages, key=lambda page: linked.index(page) if page in linked else len(linked))


def walked_blocks() -> list:
    """(doc, number, block) of the blocks the walk runs, in the walk's order."""
    blocks = bash_blocks()
    return [(doc, number, block) for page in reading_order() for doc, number, block in blocks
            if doc == page and not covered_elsewhere(block)]


@dataclass
class Block:
    """One block as the walk ran it: its page, number and text, its exit
    status, what it printed, and its wall seconds."""
    doc: str
    number: int
    text: str
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def name(self) -> str:
        return f"{self.doc}#{self.number}"


class Walk:
    """The walk in ``root`` (its folder ``root/project``, its record
    ``root/blocks.json``, what each block saved under ``root/saved``),
    made with DATA_DIR ``data_dir``. Not safe for two processes at once:
    the caller holds a lock around ``through``."""

    def __init__(self, root: Path, data_dir: Path) -> None:
        self.root, self.data_dir = Path(root), Path(data_dir)
        self.folder = self.root / "project"
        self.record = self.root / "blocks.json"

    def blocks(self) -> list:
        """The blocks run so far, in order (``Block``)."""
        if not self.record.exists():
            return []
        return [Block(**entry) for entry in json.loads(self.record.read_text())]

    def through(self, doc: str, number: Optional[int] = None) -> list:
        """Run the walk up to and including block ``number`` of ``doc``
        (None: its last one the walk runs), from where it stands; return
        every block run so far. Stops at a block that fails: later ones are
        not run (``block`` then says so)."""
        order = walked_blocks()
        targets = [index for index, (d, n, _) in enumerate(order) if d == doc and (number is None or n == number)]
        assert targets, f"the walk runs no block {doc}#{number}"
        done = self.blocks()
        if not done:
            self._prepare()
        while len(done) <= targets[-1] and (not done or done[-1].returncode == 0):
            block_doc, block_number, text = order[len(done)]
            done.append(self._run(block_doc, block_number, text))
            self.record.write_text(json.dumps([asdict(block) for block in done]))
        return done

    def block(self, doc: str, number: int) -> Block:
        """Block ``number`` of ``doc``, run (with the walk before it) if it was not yet."""
        for block in self.through(doc, number):
            if (block.doc, block.number) == (doc, number):
                assert block.returncode == 0, _failure(block)
                return block
        failed = self.blocks()[-1]
        raise AssertionError(f"the walk stopped before {doc}#{number}: {_failure(failed)}")

    def saved(self, doc: str, number: int, name: str) -> Path:
        """``name`` (a file or folder at the top of the walk's folder) as block
        ``number`` of ``doc`` left it (the walk runs that far); the later
        blocks may have changed the folder's own."""
        self.block(doc, number)
        path = self.root / "saved" / f"{doc.replace('/', '_')}#{number}" / name
        assert path.exists(), f"{doc}#{number} made or changed no {name} at the top of the walk's folder"
        return path

    def _prepare(self) -> None:
        """The folder as a newcomer's checkout (the scripts, the task modules,
        train_utils, tools, the guide's task files), ../shared beside it."""
        from test_custom_task import guide_task_module
        from dataset_files import require_mnist_t10k

        self.folder.mkdir(parents=True)
        for script in REPO.glob("*.py"):
            shutil.copy(script, self.folder)
        for package in ("train_utils", "tools"):
            shutil.copytree(REPO / package, self.folder / package, ignore=shutil.ignore_patterns("__pycache__"))
        guide_task_module(self.folder)
        bin_dir = self.root / "bin"  # `python` and `torchrun` as a user's activated environment has them
        bin_dir.mkdir()
        for name, command in (("python", [sys.executable]), ("torchrun", TORCHRUN)):
            (bin_dir / name).write_text(f"#!/bin/sh\nexec {' '.join(map(str, command))} \"$@\"\n")
            (bin_dir / name).chmod(0o755)
        # ../shared/data/mnist-t10k beside the folder, as beside a checkout (docs/recipes.md stages MNIST from it)
        (self.root / "shared" / "data").mkdir(parents=True)
        (self.root / "shared" / "data" / "mnist-t10k").symlink_to(require_mnist_t10k())

    def _run(self, doc: str, number: int, text: str) -> Block:
        """Run one block as a script (set -euo pipefail) in the folder; keep
        what it made or changed at the top of the folder (``saved``)."""
        before = _stamps(self.folder)
        env = script_env(DATA_DIR=str(self.data_dir), PATH=f"{self.root / 'bin'}{os.pathsep}{os.environ['PATH']}")
        started = time.monotonic()
        try:
            with _fixed_ports_lock(text):
                result = subprocess.run(["bash", "-c", "set -euo pipefail\n" + text], cwd=self.folder, env=env,
                                        capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
            returncode, stdout, stderr = result.returncode, result.stdout, result.stderr
        except subprocess.TimeoutExpired as exc:
            returncode, stdout, stderr = -9, _text(exc.stdout), _text(exc.stderr) + f"\n(killed after {exc.timeout} s)"
        block = Block(doc, number, text, returncode, stdout, stderr, round(time.monotonic() - started, 1))
        print(f"{block.name}: {block.seconds} s, exit {returncode}")
        kept = self.root / "saved" / f"{doc.replace('/', '_')}#{number}"
        kept.mkdir(parents=True)
        for path in self.folder.iterdir():
            if (path.name not in NOT_KEPT and _stamp(path) != before.get(path.name)
                    and _size(path) <= KEEP_AT_MOST_BYTES):
                if path.is_dir():
                    shutil.copytree(path, kept / path.name, symlinks=True)
                else:
                    shutil.copy2(path, kept / path.name, follow_symlinks=False)
        return block


# Blocks that meet at a fixed port, as written: multigpu_spawn.py's localhost:12355 and the
# README's two-node demo's --rdzv-endpoint=localhost:29400.
FIXED_PORT = re.compile(r"multigpu_spawn\.py|--rdzv-endpoint=localhost:")


def _fixed_ports_lock(text: str):
    """A lock the whole machine shares, held while a block that meets at a
    fixed port runs: another test session (.ci/run's oldest-torch step, beside
    the main suite) walks the README too, and the second to bind the port
    would fail. Other blocks need none (a null context)."""
    import contextlib

    from filelock import FileLock

    if not FIXED_PORT.search(text):
        return contextlib.nullcontext()
    return FileLock(str(Path(tempfile.gettempdir()) / "ddp-tutorial-walk-fixed-ports.lock"))


def _failure(block: Block) -> str:
    return (f"{block.name} exited {block.returncode}:\n{block.text}\n--- stdout\n{block.stdout[-3000:]}"
            f"\n--- stderr\n{block.stderr[-3000:]}")


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def _stamp(path: Path) -> tuple:
    """What tells that ``path`` (a file, or a folder's whole tree) changed: its files' names, sizes and mtimes."""
    if not path.is_dir():
        stat = path.lstat()
        return ((path.name, stat.st_size, stat.st_mtime_ns),)
    return tuple(sorted((str(p.relative_to(path)), p.lstat().st_size, p.lstat().st_mtime_ns)
                        for p in path.rglob("*") if "__pycache__" not in p.parts))


def _stamps(folder: Path) -> dict:
    return {path.name: _stamp(path) for path in folder.iterdir()}


def _size(path: Path) -> int:
    if not path.is_dir():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*"))
