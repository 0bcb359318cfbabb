"""The tests' fork server (support/forkserver.py) and the pods launcher that
asks it for ranks (support/pods.py): a forked rank runs its script as
``python SCRIPT ARGS`` would, with torch imported once, in the server."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from helpers import PODS, REPO, script_env

PROBE = '''import json, os, signal, sys
preloaded = "torch" in sys.modules  # before this script imports anything of its own
sys.stdout.write(json.dumps({"rank": int(os.environ["RANK"]), "pid": os.getpid(), "name": __name__, "argv": sys.argv, "path0": sys.path[0],
                  "cwd": os.getcwd(), "umask": os.umask(0), "preloaded": preloaded, "ppid": os.getppid(),
                  "tag": os.environ.get("PROBE_TAG"), "term": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                  "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))}) + "\\n")  # one write a line:
sys.stdout.flush()  # the ranks share the pipe, and print() writes the newline apart
if sys.argv[1] == "fail":
    raise SystemExit(3 + int(os.environ["RANK"]))
if sys.argv[1] == "raise":
    raise ValueError("the probe's error")
if sys.argv[1] == "wait":
    import time
    time.sleep(60)
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A fork server of this test's own, listening: (its process, the
    environment that asks it, its CPU file)."""
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp(prefix="forkserver-test-"))
    env = script_env()
    process = subprocess.Popen([sys.executable, REPO / "support" / "forkserver.py", folder / "socket",
                                folder / "cpu"], stdin=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 300  # the first tests start beside installs and an image build
    while not (folder / "socket").exists():
        assert process.poll() is None and time.monotonic() < deadline, "the fork server did not start"
        time.sleep(0.1)
    yield process, dict(env, FORKSERVER_SOCKET=str(folder / "socket")), folder / "cpu"
    process.stdin.close()
    process.wait(timeout=60)


def probe(tmp_path, env: dict, mode: str, nproc: int = 2, **popen) -> subprocess.Popen:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    return subprocess.Popen([*PODS, f"--nproc_per_node={nproc}", script.name, mode], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def lines(stdout: str) -> list:
    import json

    return sorted((json.loads(line) for line in stdout.splitlines()), key=lambda line: line["rank"])


def test_a_served_rank_runs_its_script_as_python_would(server, tmp_path):
    """From the server: __main__, argv, the script's folder first on
    sys.path, the asker's folder, umask and environment, default handlers and
    no blocked signal, torch imported before the script's first line; the
    exit status of the first failed rank; the ranks' CPU seconds noted."""
    process, env, cpu_file = server
    before = len(cpu_file.read_text().split())
    job = probe(tmp_path, dict(env, PROBE_TAG="asked"), "fail", preexec_fn=lambda: __import__("os").umask(0o027))
    stdout, stderr = job.communicate(timeout=300)
    assert job.returncode == 3, stderr  # rank 0's 3 (rank 1's is 4): the first failed rank's
    ranks = lines(stdout)
    assert [rank["rank"] for rank in ranks] == [0, 1]
    for rank in ranks:
        assert rank["name"] == "__main__" and rank["argv"] == ["probe.py", "fail"], rank
        assert rank["path0"] == str(tmp_path) and rank["cwd"] == str(tmp_path) and rank["umask"] == 0o027, rank
        assert rank["preloaded"] and rank["ppid"] == process.pid and rank["tag"] == "asked", rank
        assert rank["term"] and rank["blocked"] == [], rank
    assert len(cpu_file.read_text().split()) == before + 2


def test_an_uncaught_exception_is_printed_and_exits_1(server, tmp_path):
    job = probe(tmp_path, server[1], "raise", nproc=1)
    _, stderr = job.communicate(timeout=300)
    assert job.returncode == 1 and "Traceback" in stderr and "ValueError: the probe's error" in stderr, stderr


def test_a_signal_to_the_launcher_reaches_the_served_ranks(server, tmp_path):
    job = probe(tmp_path, server[1], "wait")
    assert job.stdout.readline() and job.stdout.readline()  # both ranks run
    job.send_signal(signal.SIGTERM)
    stdout, stderr = job.communicate(timeout=60)
    assert job.returncode == 128 + signal.SIGTERM, stderr


def test_an_environment_read_at_import_is_refused_and_the_launcher_forks_itself(server, tmp_path):
    """OMP_NUM_THREADS other than the server's: not from the server (its
    torch read the server's); pods.py imports torch and forks the ranks."""
    process, env, _ = server
    job = probe(tmp_path, dict(env, OMP_NUM_THREADS="3"), "run")
    stdout, stderr = job.communicate(timeout=300)
    assert job.returncode == 0, stderr
    ranks = lines(stdout)
    assert all(rank["ppid"] == job.pid and rank["preloaded"] for rank in ranks), ranks


def test_ranks_whose_launcher_is_killed_are_killed_and_the_server_serves_on(server, tmp_path):
    """pods.py SIGKILLed (a test's time-out) while its served ranks run: the
    server kills them; an asker that goes away in the middle of its request
    starts nothing; and the next launch is served as before."""
    import json
    import os
    import socket

    process, env, _ = server
    job = probe(tmp_path, env, "wait")
    pids = [json.loads(job.stdout.readline())["pid"] for _ in range(2)]
    job.kill()
    job.communicate(timeout=60)
    deadline = time.monotonic() + 60  # bounds a failure only

    def running(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    while any(running(pid) for pid in pids):
        assert time.monotonic() < deadline, pids
        time.sleep(0.1)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as asker:  # half a request, then gone
        asker.connect(env["FORKSERVER_SOCKET"])
        socket.send_fds(asker, [b'{"argv": ["probe.py"'], [0, 1, 2])
    again = probe(tmp_path, env, "run", nproc=1)
    stdout, stderr = again.communicate(timeout=120)
    assert again.returncode == 0 and lines(stdout)[0]["ppid"] == process.pid, stderr
