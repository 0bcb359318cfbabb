"""Two nodes on this machine: two torchrun agents, one process each, meeting
through c10d rendezvous on localhost, as the README shows: the multinode.py
rung trains across them; the kit (train.py) refuses a snapshot that only one
node's disk holds."""

from helpers import REPO, TORCHRUN, epochs, error_lines, free_port, parse_test, run_together, script_env


def _start_nodes(port, cwds, extra=(), script="multinode.py"):
    cmds = [TORCHRUN + ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=localhost:{port}", f"--rdzv-id=test{port}",
                        # the first agent hosts the rendezvous store
                        f"--rdzv-conf=is_host={int(node == 0)}",
                        str(REPO / script), "--total_epochs", "2", *extra]
            for node in range(len(cwds))]
    return run_together(cmds, cwds, script_env())

def test_two_nodes_train_together(tmp_path):
    outputs = _start_nodes(free_port(), [tmp_path, tmp_path])
    for code, stdout, stderr in outputs:
        assert code == 0, stderr[-4000:]
    everything = outputs[0][1] + outputs[1][1]
    ranks = sorted({line.split("|")[0] for line in everything.splitlines() if line.startswith("[rank ")})
    assert ranks == ["[rank 0 ", "[rank 1 "], everything
    # Each node runs one process: local rank 0 on both, global ranks 0 and 1.
    assert everything.count("| local_rank 0 | host ") == 4  # 2 ranks x 2 epochs
    # Global rank 0 alone prints the summary and saves.
    summary = [out for _, out, _ in outputs if epochs(out)]
    assert len(summary) == 1 and len(epochs(summary[0])) == 2
    assert parse_test(summary[0])["loss"] < 0.1
    assert (tmp_path / "snapshot_multinode.pt").exists()
    # The global batch is 2 x 32: 1844 samples -> 922 per rank -> 28 steps of 32
    assert "batch_size 32 | steps 28" in everything


def test_snapshot_visible_on_one_node_only_is_refused(tmp_path):
    """Nodes with separate disks: a relative --snapshot_path found on node 0 but
    not on node 1 would resume one and restart the other. The kit refuses, and
    the existing snapshot is left as it was."""
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir()
    node1.mkdir()
    # A real snapshot on node 0's disk, from a finished two-node run there.
    first = _start_nodes(free_port(), [node0, node0], script="train.py")
    assert all(code == 0 for code, _, _ in first)
    before = (node0 / "snapshot_train.pt").read_bytes()
    outputs = _start_nodes(free_port(), [node0, node1], extra=["--total_epochs", "3"], script="train.py")
    assert all(code != 0 for code, _, _ in outputs)
    errors = [line for _, _, err in outputs for line in error_lines(err)]
    assert errors == ["error: snapshot snapshot_train.pt is missing on ranks [1] but present on others; "
                      "--snapshot_path must be on storage that every node shares"]
    assert (node0 / "snapshot_train.pt").read_bytes() == before
    assert not (node1 / "snapshot_train.pt").exists()
