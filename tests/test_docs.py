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

The pages also speak to users in the present (no narration of earlier
versions, issues or sessions), their measured figures sit in results tables,
and their links lead to a file and a heading that exist.
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
    if "--dataset tokens" in block and not block.lstrip().startswith("sbatch"):
        return ("--dataset tokens needs nanoGPT's token files and trains for minutes to days; "
                "tests/test_token_files.py trains it on Tiny Shakespeare's shakespeare_char files")
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


# --------------------------------------------------------------------------
# The pages speak to users in the present, and their figures sit in tables
# --------------------------------------------------------------------------
#
# What the pages claim is checked, not a list of phrases: (a) no sentence
# narrates the project's past (an earlier version, a change, a session, an
# issue, what is not measured yet), and (b) every measured figure stands in a
# results table, in the caption beside one, or in a sentence that cites one.
# Code (fenced and indented blocks, inline spans) is never read.

def page_blocks(text: str) -> list:
    """(kind, first line, text) of a page's paragraphs, list items and tables
    outside code, in order; kind is "prose", "table" or "title" (a paragraph
    that is bold and nothing else, right before a table: its title). Headings
    and code blocks are left out."""
    blocks, current, kind, fence, previous = [], [], None, False, ""

    def close():
        if current:
            blocks.append((kind, start, " ".join(current)))

    start = 0
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        indented_code = line.startswith("    ") and not current and not previous.strip()
        previous = line
        if stripped.startswith("```") or fence or indented_code or not stripped or line.startswith("#"):
            if stripped.startswith("```"):
                fence = not fence
            close()
            current, kind = [], None
            continue
        line_kind = "table" if stripped.startswith("|") else "prose"
        if line_kind != kind or re.match(r"(?:[-*]|\d+\.) ", stripped):  # a new list item starts a block
            close()
            current, kind, start = [], line_kind, number
        current.append(stripped)
    close()
    return [("title", line, block) if kind == "prose" and re.fullmatch(r"\*\*[^*]+\*\*:?", block)
            and following[0] == "table" else (kind, line, block)
            for (kind, line, block), following in zip(blocks, blocks[1:] + [("end", 0, "")])]


def _spans_out(text: str) -> str:
    """``text`` with each inline code span replaced by `…`, but for a file
    name (`train.py`), which reads as a word."""
    return re.sub(r"`([^`]*)`", lambda m: m.group(0) if re.fullmatch(r"[\w./-]+\.(?:py|sh|md)", m.group(1))
                  else "`…`", text)


def sentences(block: str) -> list:
    """(sentence as written, sentence with code spans out) of a block, split
    after a full stop, never inside a code span."""
    spans = re.findall(r"`[^`]*`", block)
    held = re.sub(r"`[^`]*`", "\0", block)  # each span held out while splitting
    parts = []
    for part in re.split(r"(?<=[.!?])\s+(?=[A-Za-z*(\[\0])", held):
        while "\0" in part:
            part = part.replace("\0", spans.pop(0), 1)
        parts.append(part)
    return [(part, _spans_out(part)) for part in parts if part.strip()]


# (a) Past-version narration. The project in the past tense: its own names
# as the subject of a past verb ("the kit trained", "the wrappers ran").
PROJECT = r"(?:\b(?:[Tt]he kit|[Tt]his project|[Tt]he project|[Tt]he scripts|[Tt]he rungs|[Tt]he wrappers|" \
          r"[Tt]he tests|[Tt]he test suite|[Tt]he suite|[Tt]he benchmark|[Tt]his page|[Ww]e|train\.py)|`train\.py`)"
PAST = r"(?:was|were|had|did|ran|took|gave|grew|brought|became|trained|measured|compared|reached|changed|" \
       r"added|removed|replaced|dropped|moved|passed|failed|used|kept)"
NARRATION = {
    "an issue or pull request": r"\bissues? #?\d+|(?<![\w/.-])#\d+\b|\bpull requests?\b",
    "the work's sessions and machines": r"\bsessions?\b|\bthis (?:work|change|commit|VM)\b|\bon this machine\b"
                                       r"|\b(?:seen|measured|found|ran|tried) here\b|\bno GPU was (?:lent|available)\b",
    "an earlier state": r"\b(?:earlier|previous|older|former|old|first) (?:versions?|design|method|code|layout|"
                        r"implementation)\b|\bversion of (?:the|this) (?:page|test|benchmark|kit|scripts?|project|docs?)\b"
                        r"|\bin (?:an|the) earlier (?:run|one)\b|\bused to\b|\bno longer\b|\bpreviously\b"
                        r"|\bformerly\b|\boriginally\b|\bpre-?dates?\b|\bsince (?:merged|removed|replaced|renamed|"
                        r"then|fixed)\b|\b(?:at|of) that time\b|\bmeasured (?:then|again)\b|\bnot in the suite\b",
    "a contrast with the past ('now')": r"\bnow\b",
    "'before' a past change": r"\bbefore\b(?:(?!\b(?:is|are|be|been|being)\b)[^.;:()]){0,60}?\b"
                              r"(?:was|were|had|did|ran|trained|took|kept|used|became)\b",
    "what is not measured or tested yet": r"\buntested\b|\bnot (?:tested|measured|tried|run|reproduced|checked) "
                                          r"(?:here|yet)\b|\b(?:measured|tested|figures?|results?|numbers?|"
                                          r"covered)\b[^.;:]{0,30}\byet\b",
}
PROJECT_PAST = PROJECT + r"(?:\s+[\w'-]+){0,3}?\s+" + PAST + r"\b"
# Past tense that is not narration: a counterfactual ("as if nothing had
# happened", "would have"); and tables and their captions, which report
# what a measured run did (a user's run, rank or job in the past tense is
# never matched: only the project's own names are).
COUNTERFACTUAL = r"\bas if\b|\bwould have\b"


def narration(text: str) -> list:
    """The page's sentences that narrate the project's past: (line, what, sentence)."""
    found = []
    blocks = page_blocks(text)
    in_captions = captions(blocks)
    for index, (kind, line, block) in enumerate(blocks):
        for written, plain in sentences(block):
            for what, pattern in NARRATION.items():
                if re.search(pattern, plain, re.I):
                    found.append((line, what, written))
            if (kind == "prose" and index not in in_captions and re.search(PROJECT_PAST, plain)
                    and not re.search(COUNTERFACTUAL, plain)):
                found.append((line, "the project in the past tense", written))
    return found


# (b) Measured figures: a number with a unit of time, rate, size or share, a
# ratio ("1.82x"), a loss or an accuracy's value, or a count of runs ("2 of
# 5 runs").
NUMBER = r"(?<![\w.,/])(?<![A-Za-z]-)\d[\d,]*(?:\.\d+)?"  # not CRC-32
UNIT = (r"(?:\s?(?:samples/s|tokens/s|images/s|steps/s|[GTMk]?FLOP/s|nats(?:/char)?|ms|us|µs|s|seconds?|"
        r"min|minutes?|h|hours?|[KMGT]i?B(?:/s)?|kB|bytes)(?![\w/])|\s?%|x(?![\w-]))")
FIGURES = [NUMBER + UNIT, r"\b(?:loss|accuracy) (?:of |was |is |reache[sd] )?(\d+\.\d+)",
           r"\b(?:\d+|one|once|twice) (?:in|of) (?:about )?\d+ (?:[\w-]+ ){0,2}runs\b"]
# A figure is a setting, not a measurement, when its clause says so (a
# default, a limit, an interval) or when the sentence gives the flag that sets
# it (`--shutdown-timeout=80`: 80 s); a definition when its clause derives it
# (ln 65 = 4.17 nats, an fp32 weight's 4 bytes); a split of a dataset when it
# is a share of one ("the first 90% of the text").
SETTING = r"\b(?:defaults?|unless|set|sets|(?:lowered|raised) to|limit|timeouts?|time-outs?|at most|at least|" \
          r"up to|every (?:about )?\d+|allows?)\b|[<>]=|[≤≥]"
DEFINITION = r"=|\b(?:fp32|fp16|bf16|float32|uint8|int64)\b"
SPLIT = r"(?:first|last|seeded|held-out) \d+%|\d+% of (?:the|its) (?:[\w-]+ )?(?:split|text|set|data)\b"
CITES_A_TABLE = r"\btables?\b"


def captions(blocks: list) -> set:
    """The indices of the prose blocks that caption a table: each one right
    before or after a table or its title (the machine, torch, what ran),
    and the one-line notes, not sentences, next to a caption (the
    benchmark's "(30 s; load average after: ...)")."""
    anchors = {i for i, (kind, _, _) in enumerate(blocks) if kind in ("table", "title")}
    found = {i for i, (kind, _, _) in enumerate(blocks)
             if kind == "prose" and (i - 1 in anchors or i + 1 in anchors)}
    grown = True
    while grown:
        notes = {i for i, (kind, line, block) in enumerate(blocks)
                 if kind == "prose" and i not in found and (i - 1 in found or i + 1 in found)
                 and len(block) <= 80 and not block.endswith(".")}
        found |= notes
        grown = bool(notes)
    return found


def _numbers(text: str) -> set:
    return {n.replace(",", "") for n in re.findall(r"\d[\d,]*(?:\.\d+)?", text)}


def _quoted(figure: str, number: str, results: str) -> bool:
    """Whether ``figure`` quotes the page's results (its tables, their titles
    and captions): the figure as written, unit and all, or a number
    distinctive enough to name one entry (a decimal point, or 3 digits)."""
    return (re.sub(r"\s", "", figure) in re.sub(r"\s", "", results)
            or bool(re.search(r"\.|\d{3}", number)) and number in _numbers(results))


def loose_figures(text: str) -> list:
    """The page's measured figures outside tables and their captions that
    neither cite a table, nor quote a figure of the page's tables (with their
    titles and captions), nor are settings, definitions or splits: (line,
    figure, sentence)."""
    blocks = page_blocks(text)
    in_captions = captions(blocks)
    results = " ".join(block for index, (kind, _, block) in enumerate(blocks)
                       if kind != "prose" or index in in_captions)
    found = []
    for index, (kind, line, block) in enumerate(blocks):
        if kind != "prose" or index in in_captions:
            continue
        for written, plain in sentences(block):
            if re.search(CITES_A_TABLE, plain):
                continue
            spans = " ".join(re.findall(r"`([^`]*)`", written))  # the flags' values the sentence gives
            clauses = re.split(r"[;:()]", plain)
            for clause in clauses:
                if re.search(SETTING, clause) or re.search(DEFINITION, clause):
                    continue
                for pattern in FIGURES:
                    for match in re.finditer(pattern, clause):
                        figure = match.group(0)
                        number = re.search(r"\d[\d,]*(?:\.\d+)?", figure).group(0).replace(",", "")
                        if (_quoted(figure, number, results) or number in _numbers(spans)
                                or re.search(SPLIT, clause)):
                            continue
                        found.append((line, figure, written))
    return found


def test_user_pages_speak_in_the_present():
    """README.md and docs/*.md tell users what is true now: no sentence about
    an earlier version, a change, an issue or a work session, nor about what
    is not measured or tested yet; the project's own names are never the
    subject of a past verb outside a results table and its caption."""
    found = [f"{doc.relative_to(REPO)}:{line}: {what}: {sentence}"
             for doc in DOCS for line, what, sentence in narration(doc.read_text())]
    assert not found, "\n".join(found)


def test_measured_figures_sit_in_results_tables():
    """Every measured figure of README.md and docs/*.md (a time, a rate, a
    size, a share, a ratio, a loss or accuracy, a count of runs) stands in a
    table, in the caption beside one (which names the machine and torch), in
    a sentence that cites a table or quotes a figure of the page's tables; or
    it is a setting (a default, a limit, the value of a flag the sentence
    gives), a definition or a split of a dataset."""
    found = [f"{doc.relative_to(REPO)}:{line}: {figure!r} in: {sentence}"
             for doc in DOCS for line, figure, sentence in loose_figures(doc.read_text())]
    assert not found, "\n".join(found)


def test_the_voice_checks_can_fail():
    """Lab notes and loose figures are found; what users need is not."""
    lab_notes = [
        "| not in the suite now (an earlier version of the test) | 0.966 |",
        "8b, run before one process trained without DDP's wrapper:",
        "The kit trained at nanoGPT's rate.",
        "Fixed in issue #24; untested here.",
        "The kit's run above predates its fused AdamW.",
        "Three things brought the step down (the same session).",
        "Measured here: no GPU was lent.",
        "It is not measured yet.",
        "The CIFAR-stem ResNet-18, now the default, has no row.",
        "The node is no longer part of the allocation.",
        "`train.py` was slower than nanoGPT.",
    ]
    for text in lab_notes:
        assert narration(text), text
    for text in ["A run that was stopped by SIGTERM resumes where it stopped.",
                 "The container trained on to its last epoch as if nothing had happened.",
                 "`train.py` prints `recipe changed ... now runs to epoch 4`.",
                 "The previous snapshot is whole; an earlier run's file is replaced."]:
        assert not narration(text), text
    loose = ["One epoch took 2.1 s with `--amp` and 3.7 s without.",
             "Two processes train 1.82x the tokens/s of one.",
             "After 1,307 steps the validation loss was 1.9904.",
             "A minimal script hung in 2 of 5 runs.",
             "| wait | 30 |\n|---|---|\n\n" + "A caption, long enough to be more than a one-line note. " * 2
             + "\n\nA stuck rank is killed 30 s after its SIGTERM."]
    for text in loose:
        assert loose_figures(text), text
    table = "| run | epoch s |\n|---|---|\n| fp32 | 3.7 |\n"
    for text in ["`--pg_timeout_s` (default 600 s) applies from the second step on.",
                 "SIGUSR1 comes 90 s before the time limit.",
                 "torchrun kills them 80 s later in the wrappers (`--shutdown-timeout=80`).",
                 "A uniform guess scores ln 65 = 4.17 nats; an fp32 weight is 4 bytes.",
                 "The first 90% of the text trains.",
                 "Training takes 2.1 s with `--amp` in the table below.",
                 "Measured on a 2-core EPYC, torch 2.14.1: 2.1 s with `--amp`.\n\n" + table,
                 table + "\nWithout `--amp` the epoch takes 3.7 s."]:
        assert not loose_figures(text), text


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
    task modules, train_utils, the programs in tools/, the guide's
    my_task.py); return the environment of a shell with the test environment
    activated and DATA_DIR set."""
    for script in REPO.glob("*.py"):  # the scripts and the task modules
        shutil.copy(script, folder)
    for package in ("train_utils", "tools"):
        shutil.copytree(REPO / package, folder / package, ignore=shutil.ignore_patterns("__pycache__"))
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


def test_every_flag_has_its_row_in_flags_md():
    """docs/flags.md lists every flag of train.py (the kit's and the built-in
    tasks' FLAGS) in its table, a row naming one flag or a few alike."""
    import text_tasks
    import vision_tasks
    from train_utils.config import flags

    first_cells = re.findall(r"^\| ([^|]+) \|", (REPO / "docs" / "flags.md").read_text(), re.M)
    rows = {name for cell in first_cells for name in re.findall(r"`(--\w+)`", cell)}
    names = {f"--{f.name}" for f in flags()} | {f"--{name}" for module in (text_tasks, vision_tasks)
                                                  for name in getattr(module, "FLAGS", {})}
    assert sorted(names - rows) == []
