"""Two nodes on this machine: two torchrun agents, one process each, meeting
through c10d rendezvous on localhost, as the README shows (its Step 4, the
multinode.py rung across them, runs in the newcomer's walk: tests/test_ladder.py):
the kit (train.py) refuses a snapshot that only one node's disk holds."""

from helpers import REPO, TORCHRUN, error_lines, free_port, run_together, script_env


def _start_nodes(port, cwds, *flags, script="train.py"):
    """Two torchrun agents, one process each, as two nodes, each in its folder of ``cwds``: ``script`` ``flags``."""
    cmds = [TORCHRUN + ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=localhost:{port}", f"--rdzv-id=test{port}",
                        # the first agent hosts the rendezvous store
                        f"--rdzv-conf=is_host={int(node == 0)}",
                        str(REPO / script), *flags]
            for node in range(len(cwds))]
    return run_together(cmds, cwds, script_env())


def test_snapshot_visible_on_one_node_only_is_refused(finished_run, tmp_path):
    """Nodes with separate disks: a relative --snapshot_path found on node 0 but
    not on node 1 would resume one and restart the other. The kit refuses, and
    the existing snapshot is left as it was."""
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir()
    node1.mkdir()
    finished_run(node0, total_epochs=2)  # a real snapshot on node 0's disk: train.py, world size 2, 2 epochs
    before = (node0 / "snapshot_train.pt").read_bytes()
    outputs = _start_nodes(free_port(), [node0, node1], "--total_epochs", "3")
    assert all(code != 0 for code, _, _ in outputs)
    errors = [line for _, _, err in outputs for line in error_lines(err)]
    assert errors == ["error: snapshot snapshot_train.pt is missing on ranks [1] but present on others; "
                      "--snapshot_path must be on storage that every node shares"]
    assert (node0 / "snapshot_train.pt").read_bytes() == before
    assert not (node1 / "snapshot_train.pt").exists()
