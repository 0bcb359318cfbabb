"""Two nodes on this machine: two torchrun agents, one process each, meeting
through c10d rendezvous on localhost, as the README shows (its Step 4, the
multinode.py rung across them, runs in the newcomer's walk: tests/test_ladder.py):
the kit (train.py) refuses a snapshot that only one node's disk holds."""

from helpers import REPO, TORCHRUN, error_lines, free_port, run_together, script_env


def cpp_stack_lines(stderr: str) -> list:
    """The lines of torch's C++ warnings in ``stderr`` with their stacks (c10's log
    of a TCPStore error: ``[W... TCPStore.cpp:138] [c10d] ...``, then ``frame #N: ...``)."""
    return [line for line in stderr.splitlines() if "TCPStore.cpp" in line or "] [c10d] " in line
            or line.startswith(("Exception raised from", "frame #", "<omitting python frames>"))]



def _start_nodes(port, cwds, *flags, script="train.py", **env):
    """Two torchrun agents, one process each, as two nodes, each in its folder
    of ``cwds``: ``script`` ``flags``, ``env`` added to the environment. The
    first agent hosts the rendezvous store; the second looks at its workers
    every 3 s, so that when the workers end it closes its part of the
    rendezvous after the first has exited with the store (docs/runs.md: the
    node that prints torch's store warnings)."""
    cmds = [TORCHRUN + ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=localhost:{port}", f"--rdzv-id=test{port}",
                        f"--rdzv-conf=is_host={int(node == 0)}", f"--monitor-interval={3 if node else 0.1}",
                        str(REPO / script), *flags]
            for node in range(len(cwds))]
    return run_together(cmds, cwds, script_env(**env))


def test_snapshot_visible_on_one_node_only_is_refused(finished_run, tmp_path):
    """Nodes with separate disks: a relative --snapshot_path found on node 0 but
    not on node 1 would resume one and restart the other. The kit refuses, and
    the existing snapshot is left as it was. Under TORCH_CPP_LOG_LEVEL=ERROR
    (docs/runs.md) the second node's torchrun, which comes to the rendezvous
    store after the first has exited with it (on most runs: a race), prints
    no C++ stack, while the run's error line still shows."""
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir()
    node1.mkdir()
    finished_run(node0, total_epochs=2)  # a real snapshot on node 0's disk: train.py, world size 2, 2 epochs
    before = (node0 / "snapshot_train.pt").read_bytes()
    outputs = _start_nodes(free_port(), [node0, node1], "--total_epochs", "3", TORCH_CPP_LOG_LEVEL="ERROR")
    assert all(code != 0 for code, _, _ in outputs)
    errors = [line for _, _, err in outputs for line in error_lines(err)]
    assert errors == ["error: snapshot snapshot_train.pt is missing on ranks [1] but present on others; "
                      "--snapshot_path must be on storage that every node shares"]
    # Whether the second agent reaches the store after it is gone ("has failed to shutdown the
    # rendezvous") depends on the machine's load; the 3 s look makes it likely, not certain. Either
    # way no C++ stack shows (without the setting, 29 lines when it happens).
    stacks = [line for _, _, err in outputs for line in cpp_stack_lines(err)]
    assert stacks == [], "\n".join(stacks)
    assert (node0 / "snapshot_train.pt").read_bytes() == before
    assert not (node1 / "snapshot_train.pt").exists()
