"""The progress bars: on a terminal, rank 0 shows one per training epoch (with
its running loss) and one per evaluation; a log file gets none."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import termios

from helpers import REPO, TORCHRUN, free_port, script_env


def run_on_a_terminal(cmd: list, cwd, timeout: float = 300) -> str:
    """Run ``cmd`` with stdout and stderr on a pseudo-terminal 120 columns wide
    (tqdm draws nothing at width 0); return what it wrote, carriage returns as
    newlines."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: its stdio is the terminal
        os.chdir(cwd)
        os.execve(cmd[0], [str(c) for c in cmd], script_env())
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    _, status = os.waitpid(pid, 0)
    text = out.decode(errors="replace").replace("\r", "\n")
    assert os.waitstatus_to_exitcode(status) == 0, text[-3000:]
    return text


def test_a_terminal_gets_training_and_evaluation_bars_with_the_running_loss_from_rank_0(tmp_path):
    """Under torchrun, 2 ranks on a terminal: a bar per epoch and per
    evaluation, rank 0's alone, with its running loss."""
    text = run_on_a_terminal([*TORCHRUN, "--nproc_per_node=2", f"--master_port={free_port()}",
                              REPO / "train.py", "--total_epochs", "2"], tmp_path)
    assert "epoch 1/2:" in text and "epoch 2/2:" in text, text[-3000:]
    assert "rank 0 loss " in text and "evaluating:" in text, text[-3000:]
    assert "rank 1 loss " not in text, text[-3000:]


def test_a_log_file_gets_no_bar(newcomer_walk):
    """What the README's and the docs' commands print to a file or a pipe (the
    newcomer's walk captures it): no bar."""
    blocks = newcomer_walk.through("README.md")
    assert [block.name for block in blocks if "it/s" in block.stderr or "evaluating" in block.stderr] == []
