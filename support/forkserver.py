"""A fork server for the tests' ranks: one interpreter that has imported
torch, from which each process a test starts as ``python SCRIPT ARGS`` is
forked, so that its start costs a fork, not the 3 CPU-seconds of importing
torch (and ``torch._dynamo``, which torch imports at a training step's
first call) that a fresh interpreter spends on this project's test machine.

    python support/forkserver.py SOCKET CPU_FILE   # serves until its stdin closes

tests/conftest.py starts one for each test process and names its socket in
``FORKSERVER_SOCKET``; ``support/pods.py`` asks it for its ranks (and
forks them from itself where there is none, or where the server refuses).
Nothing of the project is imported before the fork: the script runs from
its first line in the forked process (``become``), as ``python SCRIPT ARGS``
would run it: ``__main__``, ``sys.argv``, the script's folder first on
``sys.path``, the asker's working folder, umask, environment, stdin,
stdout and stderr, default signal handlers, and the interpreter's own exit
(its exit status, a traceback for an uncaught exception, ``atexit``).

What differs from a fresh interpreter, and why it is safe for the tests:
the process's parent is the server, not the asker (the asker learns the
exit status and CPU seconds over the socket, and the server kills the
process if the asker goes away first); the hash seed is the server's
(``PYTHONHASHSEED``: an order that differs between fresh processes, a set
of strings, is the same in all; the runs under torchrun and Slurm start
every rank fresh); and what the libraries read from the environment when
they are imported is read from the server's, so the server refuses a
process whose environment differs from its own in any variable of
``IMPORT_TIME_PREFIXES`` (the asker then starts it itself).

Protocol, one Unix stream connection a process: the asker sends one JSON
line {"argv", "env", "cwd", "umask"} with its stdin, stdout and stderr
attached (SCM_RIGHTS); the server answers "pid N\\n" (or "refused
REASON\\n"), then "exit STATUS CPU_SECONDS\\n" once the process has ended
(STATUS as ``subprocess``'s returncode: -N for signal N). Each ended
process's CPU seconds are also appended to CPU_FILE, a line each, which
the test's CPU accounting reads (the process is not the test's child).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import io
import json
import os
import selectors
import signal
import socket
import sys
import types

# Imported once, in the server: what every training rank imports (torch._dynamo at
# its first optimizer or DDP call). Nothing of the project.
PRELOADED = ("torch", "torch._dynamo", "torch.distributed", "numpy")
# Variables the interpreter or those libraries read at start-up or import: a
# process whose environment differs from the server's in one is refused.
IMPORT_TIME_PREFIXES = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "TORCH", "CUDA", "LD_",
                        "MALLOC", "NVIDIA", "XDG_CACHE", "TRITON")
# Signals whose handlers a fresh interpreter starts with: Python's own for SIGINT, else the default.
STARTING_HANDLERS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL,
                     signal.SIGHUP: signal.SIG_DFL, signal.SIGQUIT: signal.SIG_DFL,
                     signal.SIGUSR1: signal.SIG_DFL, signal.SIGUSR2: signal.SIG_DFL,
                     signal.SIGCHLD: signal.SIG_DFL, signal.SIGPIPE: signal.SIG_IGN}


def preload() -> dict:
    """Import ``PRELOADED`` (what the forked processes then find imported).
    Returns the variables those imports set in the environment (torch sets
    TORCHINDUCTOR_CACHE_DIR), which a fresh process has after them too."""
    before = dict(os.environ)
    for name in PRELOADED:
        __import__(name)
    return {name: value for name, value in os.environ.items() if before.get(name) != value}


def import_time_environment(env: dict) -> dict:
    """The variables of ``env`` read at start-up or import (``IMPORT_TIME_PREFIXES``)."""
    return {name: value for name, value in env.items() if name.startswith(IMPORT_TIME_PREFIXES)}


def differing_at_import(env: dict, own_environment: dict, imported: dict) -> list:
    """The names of the variables read at import (``IMPORT_TIME_PREFIXES``)
    whose value in ``env`` differs from the server's (``own_environment``,
    before its imports), sorted; a variable the imports set
    (``imported``) may be absent from ``env`` or hold the value they set."""
    asked = import_time_environment(env)
    return sorted(name for name in set(asked) | set(own_environment)
                  if asked.get(name) != own_environment.get(name)
                  and not (name in imported and asked.get(name) in (None, imported[name])))


def become(argv: list, env: dict, imported: dict, cwd: str | None = None, umask: int | None = None) -> None:
    """In a process forked from an interpreter that ran nothing of the
    project: run ``argv`` = [SCRIPT, *ARGS] as ``python SCRIPT ARGS`` runs
    it, in ``cwd`` with ``umask`` and the environment ``env``, plus what the
    imports set in it where ``env`` has no value (``imported``, ``preload``'s).
    Its exceptions
    and ``SystemExit`` propagate: the caller lets them reach the
    interpreter, which prints and exits as a fresh one would."""
    if cwd is not None:
        os.chdir(cwd)
    if umask is not None:
        os.umask(umask)
    os.environ.clear()
    os.environ.update(env)
    for name, value in imported.items():
        os.environ.setdefault(name, value)
    for signum, handler in STARTING_HANDLERS.items():
        signal.signal(signum, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    if "numpy" in sys.modules:  # a fresh process seeds NumPy's global generator from the OS
        sys.modules["numpy"].random.seed()
    # What the interpreter does for `python SCRIPT`: the script's absolute path in its folder's
    # entry at the head of sys.path, in __file__ and its code, argv as typed, a new __main__.
    path = os.path.abspath(argv[0])
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(path)
    main = types.ModuleType("__main__")
    main.__file__, main.__loader__ = path, importlib.machinery.SourceFileLoader("__main__", path)
    sys.modules["__main__"] = main
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def serve(path: str, cpu_file: str) -> dict | None:
    """Serve on the Unix socket ``path`` until this process's stdin closes
    (then kill what it started and return None). In a forked process: its
    request (``become``'s arguments), the server's sockets closed and its
    stdin, stdout and stderr replaced by the asker's, and "imported"
    (``preload``'s) added."""
    own_environment = import_time_environment(os.environ)
    imported = preload()
    # The CPU file before the socket: a socket that exists means a server whose files are all there.
    cpu = open(cpu_file, "a")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)
    started: dict = {}  # pid -> the asker's connection
    try:
        while True:
            for key, _ in selector.select(timeout=0.05):
                if key.fileobj is sys.stdin:
                    if not os.read(sys.stdin.fileno(), 4096):
                        return None
                elif key.fileobj is listener:
                    request = _take(listener, own_environment, imported, started, selector)
                    if request is not None:  # the forked process: nothing of the server's is its own
                        for connection in [listener, *started.values()]:
                            connection.close()
                        started.clear()
                        selector.close()
                        cpu.close()
                        return dict(request, imported=imported)
                else:  # an asker went away before its process ended: end the process
                    connection = key.fileobj
                    try:
                        gone = not connection.recv(4096)
                    except OSError:  # reset by the asker's end
                        gone = True
                    if gone:
                        for pid, asker in list(started.items()):
                            if asker is connection:
                                os.kill(pid, signal.SIGKILL)
                        selector.unregister(connection)
            _reap(started, selector, cpu)
    finally:
        for pid in started:
            os.kill(pid, signal.SIGKILL)


def _take(listener: socket.socket, own_environment: dict, imported: dict, started: dict,
          selector) -> dict | None:
    """Accept one asker, read its request and fork its process. In the
    server: None (the pid sent, or the refusal). In the forked process: the
    request, stdin, stdout and stderr already the asker's."""
    connection, _ = listener.accept()
    try:
        data, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
        while not data.endswith(b"\n"):
            more = connection.recv(1 << 20)
            if not more:
                break
            data += more
    except OSError:  # reset by the asker's end
        data, fds = b"", []
    if not data.endswith(b"\n"):  # the asker went away before its request was whole: nothing to start
        for fd in fds:
            os.close(fd)
        connection.close()
        return None
    request = json.loads(data)
    differing = differing_at_import(request["env"], own_environment, imported)
    if len(fds) != 3 or differing:
        reason = "no stdin, stdout and stderr" if len(fds) != 3 else f"{differing[0]} differs"
        print(f"forkserver: refused {request['argv'][:1]}: {reason}", file=sys.stderr)
        with contextlib.suppress(OSError):  # the asker may be gone already
            connection.sendall(f"refused {reason}\n".encode())
        connection.close()
        for fd in fds:
            os.close(fd)
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            if fd > 2:
                os.close(fd)
        connection.close()
        return request
    for fd in fds:
        os.close(fd)
    started[pid] = connection
    selector.register(connection, selectors.EVENT_READ)
    try:
        connection.sendall(f"pid {pid}\n".encode())
    except OSError:  # the asker went away while its process was forked: end it (reaped as any other)
        os.kill(pid, signal.SIGKILL)
    return None


def _reap(started: dict, selector, cpu) -> None:
    """Tell the askers of the processes that ended their exit status and CPU seconds."""
    while started:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        seconds = usage.ru_utime + usage.ru_stime
        cpu.write(f"{seconds:.3f}\n")
        cpu.flush()
        connection = started.pop(pid, None)
        if connection is not None:
            with contextlib.suppress(KeyError):  # unregistered already where the asker went away first
                selector.unregister(connection)
            try:
                connection.sendall(f"exit {os.waitstatus_to_exitcode(status)} {seconds:.3f}\n".encode())
            except OSError:
                pass  # the asker is gone
            connection.close()


class Served:
    """A process the fork server started for this one: ``pid``, and once it
    has ended ``returncode`` (``subprocess.Popen``'s: -N for signal N)."""

    def __init__(self, connection: socket.socket, pid: int):
        self.connection, self.pid, self.returncode = connection, pid, None

    def poll(self):
        """The returncode, or None while the process runs."""
        if self.returncode is None:
            self.connection.setblocking(False)
            try:
                line = self.connection.recv(4096)
            except BlockingIOError:
                return None
            words = line.split()
            # The server gone without a word: the process was killed with it.
            self.returncode = int(words[1]) if words[:1] == [b"exit"] else -signal.SIGKILL
            self.connection.close()
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to the process if it still runs."""
        if self.poll() is None:
            os.kill(self.pid, signum)


def start(argv: list, env: dict) -> Served | None:
    """Ask the fork server named by ``FORKSERVER_SOCKET`` to start ``argv``
    (= [SCRIPT, *ARGS]) with ``env``, in this process's working folder and
    umask, with its stdin, stdout and stderr. None when there is no server,
    or it refuses (an environment that differs at import)."""
    path = os.environ.get("FORKSERVER_SOCKET")
    if not path:
        return None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path)
    except OSError:
        connection.close()
        return None
    umask = os.umask(0)
    os.umask(umask)
    request = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd(), "umask": umask}).encode() + b"\n"
    socket.send_fds(connection, [request], [0, 1, 2])
    reply = b""
    while not reply.endswith(b"\n"):
        more = connection.recv(4096)
        if not more:
            break
        reply += more
    words = reply.split()
    if words[:1] != [b"pid"]:
        connection.close()
        return None
    return Served(connection, int(words[1]))


if __name__ == "__main__":
    request = serve(sys.argv[1], sys.argv[2])
    if request is not None:
        become(request["argv"], request["env"], request["imported"], request["cwd"], request["umask"])
