"""--profile_dir: a few training steps traced with torch.profiler, one trace
per rank, read back as the JSON that Perfetto and TensorBoard's profiler
plugin open; the profiled run trains bitwise as an unprofiled one."""

import collections
import json
import shutil

from helpers import PODS, REPO, assert_same_snapshot, check, epochs, error_lines, one_process, run
from walk import walked_blocks

PROFILED_STEPS = [f"ProfilerStep#{n}" for n in range(2, 7)]  # training steps 3-7


def traces(folder) -> dict:
    """{file name: (the trace's rank, Counter of its complete events' names)} of --profile_dir."""
    found = {}
    for path in sorted(folder.glob("*.pt.trace.json")):
        trace = json.loads(path.read_text())
        names = collections.Counter(event["name"] for event in trace["traceEvents"] if event.get("ph") == "X")
        found[path.name] = (trace.get("distributedInfo", {}).get("rank", 0), names)
    return found


def test_torchrun_traces_each_rank_also_after_a_resume_and_trains_as_without(newcomer_walk, kit_run, tmp_path):
    """Two ranks, two traces a start, each of its own rank, with the step's
    operators and DDP's gradient all-reduce (docs/runs.md's command, in the
    newcomer's walk); resumed with the flag, the run ends bitwise where an
    unprofiled, uninterrupted one does."""
    number = next(number for doc, number, block in walked_blocks()
                  if doc == "docs/runs.md" and "--profile_dir" in block)
    block = newcomer_walk.block("docs/runs.md", number)
    assert block.stdout.count("profiler: steps 3-7 of this start traced on every rank") == 1
    shutil.copytree(newcomer_walk.saved("docs/runs.md", number, "runs") / "profile", tmp_path / "profile")
    first = traces(tmp_path / "profile")
    assert sorted(rank for rank, _ in first.values()) == [0, 1]
    for name, (rank, names) in first.items():
        assert name.startswith(f"rank{rank}.")
        assert sorted(n for n in names if n.startswith("ProfilerStep#")) == PROFILED_STEPS
        assert names["aten::addmm"] >= 5 * 2
        assert names["c10d::allreduce_"] >= 5  # DDP's gradients, at least one bucket a step
        assert names["Optimizer.step#SGD.step"] == 5

    launch = PODS + ["--nproc_per_node=2", REPO / "train.py"]
    resumed = check(run(launch + ["--total_epochs", "2", "--profile_dir", "profile", "--snapshot_path",
                                  "profile/snapshot.pt"], tmp_path))
    assert "resuming from snapshot profile/snapshot.pt after epoch 1" in resumed.stdout
    assert resumed.stdout.count("profiler: steps 3-7 of this start") == 1
    assert sorted(rank for rank, _ in traces(tmp_path / "profile").values()) == [0, 0, 1, 1]

    plain, _ = kit_run("ddp", "--total_epochs", 2)
    assert_same_snapshot(tmp_path / "profile" / "snapshot.pt", plain / "snapshot_train.pt")


def test_an_unwritable_profile_dir_stops_before_training_in_one_line(tmp_path):
    (tmp_path / "a_file").write_text("")
    result = one_process(["--profile_dir", "a_file/prof"], tmp_path)
    assert result.returncode != 0
    assert error_lines(result.stderr) == [
        "error: cannot write --profile_dir a_file/prof: a_file is a file, not a folder; pass another --profile_dir"]
    assert not epochs(result.stdout)
