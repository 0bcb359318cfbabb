"""The README: its two set-up commands are what users and CI run (keep them
true); its shape (what this is, the set-up, Steps 1-5, one per rung,
then train.py); the output it shows is what its commands print (checked by the
walk in tests/test_docs.py, which runs them); and a new shell is told how to
get `python` and `torchrun` from the environment."""

import re

import pytest

from helpers import REPO


def _readme_commands():
    block = re.search(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_readme_opens_with_the_two_commands():
    run_job, run_tests = _readme_commands()
    assert run_job.endswith(".venv/bin/python singlegpu.py")
    assert run_tests.endswith("-m pytest -v -n 3 tests")


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (REPO / ".ci" / "run").read_text()
    assert _readme_commands()[1] in ci.splitlines()
    assert "set -euo pipefail" in ci


# --------------------------------------------------------------------------
# The output the README shows is what its commands print
# --------------------------------------------------------------------------

def _section(title: str) -> str:
    """The README's text under the heading ``## <title>...``, up to the next ``## ``."""
    readme = (REPO / "README.md").read_text()
    return re.search(rf"^## {re.escape(title)}.*?\n(.*?)(?=^## )", readme, re.S | re.M).group(1)


def _blocks(text: str, kind: str) -> list:
    return re.findall(rf"```{kind}\n(.*?)```", text, re.S)


def _timing_free(line: str) -> str:
    """A summary line with its timing figures (samples/s, flop/s, epoch_s)
    blanked out; every other number stays."""
    return re.sub(r"\b(samples/s|flop/s|epoch_s) [0-9.e+-]+", r"\1 ?", line.rstrip())


def _assert_shown_in(shown: str, printed: str) -> None:
    """Every line of ``shown`` but '...' is a line of ``printed``, in the same
    order, equal but for the timing figures."""
    printed_lines = [_timing_free(line) for line in printed.splitlines()]
    position = 0
    for line in shown.splitlines():
        if line.strip() == "...":
            continue
        expected = _timing_free(line)
        assert expected in printed_lines[position:], (
            f"the README shows\n  {line}\nbut the run printed (timings blanked)\n  "
            + "\n  ".join(printed_lines))
        position = printed_lines.index(expected, position) + 1


def check_shown_output(block: str, stdout: str, doc: str = "README.md") -> None:
    """Called by tests/test_docs.py's one-folder walk, which runs the README's
    and the docs' blocks as written, with each block, what it printed and its
    page: for Step 1's block, the output shown there against its first
    command, `python singlegpu.py` (the default job is deterministic on a
    CPU; a later run in the block would start with its own `epoch 1/`); for
    the train.py section's block, the output shown against its second command
    (a resume); for docs/custom-task.md's blocks, the ```text block shown after
    a block against its last train.py run (from its `device` line); every
    number but the timings."""
    if doc == "docs/custom-task.md":
        shown = _shown_after(DOCS_SHOWN[doc].read_text(), block)
        if shown is not None:
            _assert_shown_in(shown, _last_kit_run(stdout))
        return
    if doc != "README.md":
        return
    if block == _blocks(_section("Step 1"), "bash")[0]:
        assert block.splitlines()[0] == "python singlegpu.py"
        second_start = stdout.find("epoch 1/", stdout.find("epoch 1/") + 1)
        first_run = stdout[:second_start] if second_start > 0 else stdout
        shown, = _blocks(_section("Step 1"), "text")
        _assert_shown_in(shown, first_run)
    elif block == _blocks(_section("For real runs"), "bash")[0]:
        second_run = "device " + stdout.split("\ndevice ")[1]
        _assert_shown_in(_shown_resume(), second_run)


# The pages besides the README whose shown kit output is compared with real runs.
DOCS_SHOWN = {"docs/custom-task.md": REPO / "docs" / "custom-task.md"}


def _shown_after(page: str, block: str):
    """The ```text block that follows ``block`` on ``page`` before the next
    ```bash block, when it shows a train.py run (starts with `device `); else None."""
    after = page.split("```bash\n" + block + "```", 1)[1].split("```bash", 1)[0]
    shown = _blocks(after, "text")
    return shown[0] if shown and shown[0].startswith("device ") else None


def _last_kit_run(stdout: str) -> str:
    """What the block's last train.py run printed: from its last `device ` line on."""
    starts = [m.start() for m in re.finditer(r"^device ", stdout, re.M)]
    assert starts, f"no train.py run in the output:\n{stdout}"
    return stdout[starts[-1]:]


def _shown_resume() -> str:
    return re.search(r"The second command prints.*?\n\n```text\n(.*?)```", _section("For real runs"),
                     re.S).group(1)


def test_the_shown_output_is_compared_with_real_runs():
    """check_shown_output recognises Step 1's block and the train.py section's
    (the walk in tests/test_docs.py runs them) and fails on a number that differs."""
    step_1, kit = _blocks(_section("Step 1"), "bash")[0], _blocks(_section("For real runs"), "bash")[0]
    shown, = _blocks(_section("Step 1"), "text")
    printed = shown.replace("...\n", "").replace("samples/s 2", "samples/s 9")  # timings may differ
    check_shown_output(step_1, printed + "epoch 1/2 | the block's second run\n")
    with pytest.raises(AssertionError):
        check_shown_output(step_1, printed.replace("test | loss 0.0", "test | loss 0.1"))
    resumed = _shown_resume()
    check_shown_output(kit, "device cpu | the first run\n" + resumed)
    with pytest.raises(AssertionError):
        check_shown_output(kit, "device cpu | the first run\n" + resumed.replace("epoch 3/4", "epoch 3/5"))


def test_the_custom_task_pages_shown_output_is_compared_with_real_runs():
    """Each of docs/custom-task.md's train.py outputs is recognised after its
    block, compared with the block's last train.py run, and a number that differs fails."""
    page = DOCS_SHOWN["docs/custom-task.md"].read_text()
    compared = 0
    for block in _blocks(page, "bash"):
        shown = _shown_after(page, block)
        if shown is None:
            continue
        compared += 1
        singlegpu = "epoch 1/3 | train_loss 9.9 | a rung's line\n"
        check_shown_output(block, singlegpu + shown, "docs/custom-task.md")
        first = re.search(r"train_loss \S+", shown).group(0)
        with pytest.raises(AssertionError):
            check_shown_output(block, shown.replace(first, "train_loss 1.234567"), "docs/custom-task.md")
    assert compared == 2


# --------------------------------------------------------------------------
# The README's shape: the set-up first, a step per rung, then the kit
# --------------------------------------------------------------------------

RUNGS = ["singlegpu.py", "multigpu_spawn.py", "multigpu_torchrun.py", "multinode.py", "multinode_fsdp.py"]


def test_the_readme_has_a_step_per_rung_then_the_kit():
    """The two set-up commands in its first block; then
    Step 1 to Step 5, one per rung, in ladder order, each running its rung
    and, from Step 2 on, naming the `diff -u` to read; then the train.py section."""
    readme = (REPO / "README.md").read_text()
    headings = re.findall(r"^## (.*)$", readme, re.M)
    steps = [h for h in headings if h.startswith("Step ")]
    assert len(steps) == 5 and all(h.startswith(f"Step {n}: `{rung}`")
                                   for n, (h, rung) in enumerate(zip(steps, RUNGS), start=1)), steps
    assert headings.index("For real runs: `train.py`") == headings.index(steps[-1]) + 1
    for n, (previous, rung) in enumerate(zip([None] + RUNGS, RUNGS), start=1):
        section = _section(f"Step {n}")
        assert rung in "".join(_blocks(section, "bash")), rung
        if previous:
            assert f"diff -u {previous} {rung}" in section, rung
    assert "train.py" in "".join(_blocks(_section("For real runs"), "bash"))
    assert readme.index("```bash") < readme.index("## Step 1")  # the set-up commands come first
    for doc in re.findall(r"\]\((docs/[\w-]+\.md)\)", readme):
        assert (REPO / doc).is_file(), doc


def test_the_readme_says_to_activate_the_environment_after_its_two_commands():
    """Every later command is a bare `python`/`torchrun`: right after the two
    set-up commands the README says how a new shell gets them."""
    readme = (REPO / "README.md").read_text()
    after_setup = readme.split("```", 2)[2].split("```", 1)[0]  # the prose before the next block
    assert "source .venv/bin/activate" in after_setup
