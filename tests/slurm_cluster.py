"""A real, throw-away Slurm cluster on this machine, for the wrapper tests.

One ``slurmctld`` and three ``slurmd`` daemons (Slurm 22.05 from Debian's
packages ``slurmctld slurmd slurm-client munge``), with their own ``munged``,
configuration, spool and log folders under a temporary directory:

- partition ``single``: node ``<this hostname>`` in the machine's own network,
  with four "GPUs" (GRES backed by plain files, since there is no GPU; the jobs
  then run on the CPU with gloo, as the wrappers do on a CPU node);
- partition ``multi``: nodes ``ddp-node1`` and ``ddp-node2``, each in its own
  network namespace with its own address (10.200.0.1, .2 on a bridge whose
  root-side address 10.200.0.254 is the controller's), its own hostname (a
  UTS namespace) and four file-backed "GPUs": two hosts as far as Slurm,
  torchrun and gloo can tell;
- those three with 8 CPUs each (more than the machine has:
  ``config_overrides``), so that the wrapper tests' jobs run side by side;
- partitions ``stops``, ``nograce`` and ``urgent`` over nine more such
  hosts, ``ddp-stop1``..``ddp-stop9`` (10.200.0.11-19), each with 8 "GPUs"
  and 8 CPUs (more than the machine has: ``config_overrides``), for the
  stop-path tests: preemption is on (``PreemptType=preempt/partition_prio``,
  ``PreemptMode=REQUEUE``), and a job in ``urgent`` (``PriorityTier=10``, all
  nine hosts) preempts the ``stops`` jobs (tier 1, all but 7 and 8) on
  its nodes after their ``GraceTime`` (300 s), the ``nograce`` jobs (tier 1,
  ``ddp-stop7``, ``8``, ``GraceTime=0``, many clusters' default) at once;
  ``KillWait`` (SIGTERM to SIGKILL) is 30 s, Slurm's default, set here.

Settings that this kind of machine (a gVisor sandbox, as root) needs:
``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none`` (no
cgroups), ``SlurmctldHost`` equal to the machine's hostname, slurmd started
through ``nsenter --net`` + ``unshare --uts`` (``ip netns exec`` remounts /sys
and slurmd then fails on cgroups), host names in /etc/hosts. Everything the
cluster adds (daemons, namespaces, bridge, /etc/hosts lines) is removed by
``stop()``, which runs whatever happened before it. A session killed before
its ``stop()`` (SIGKILL, a machine restart) leaves them behind; ``start()``
clears them first, or refuses in one line while the test session that made
them is still alive (the bridge, the namespaces and the host names are
machine-wide, so two sessions cannot share a machine).

Usage (as root):  ``python tests/slurm_cluster.py`` starts one, prints
``sinfo`` and stops it; the tests use it through a pytest fixture.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "sinfo", "scancel",
            "ip", "nsenter", "unshare")
NETNS_NODES = {"ddp-node1": "10.200.0.1", "ddp-node2": "10.200.0.2"}
STOP_NODES = {f"ddp-stop{i}": f"10.200.0.{10 + i}" for i in range(1, 10)}
NOGRACE_NODES = ("ddp-stop7", "ddp-stop8")  # partition nograce; the others: partition stops
STOP_NODE_SIZE = 8  # CPUs and "GPUs" of each stop-path host
# Longer than the wrappers' time-limit warning (--signal=B:USR1@90, checked about
# every 60 s): a preemption moves the job's end to the grace's end, so a shorter
# grace brings that warning too, at a moment the test cannot choose, and the
# SIGTERM path would not be the one tested. The jobs stop long before it ends.
GRACE_TIME_S = 300
KILL_WAIT_S = 30  # from SIGTERM to SIGKILL, when a job is stopped (Slurm's default)
BRIDGE, BRIDGE_ADDR = "ddpbr0", "10.200.0.254"
# The interface carrying each namespace host's address; the same name on both
# hosts, so one GLOO_SOCKET_IFNAME serves every node.
NODE_IFACE = "ddp0"
HOSTS_MARK = "# ddp-slurm-test"
# In the environment of every process a cluster starts (daemons, munged, jobs):
# the test session that owns it, as "<pid>:<start time>" (a pid alone may be
# reused), to tell a live cluster from one left by a killed session.
OWNER_VAR = "DDP_TEST_CLUSTER_OWNER"
GPUS_PER_NODE = 4  # of the local host and the two multi hosts
CPUS_PER_NODE = 8  # likewise


def unavailable_reason() -> Optional[str]:
    """Why a cluster cannot start here (not root, a missing program), or None."""
    if os.geteuid() != 0:
        return "needs root (slurmd, network namespaces)"
    missing = [name for name in BINARIES if shutil.which(name) is None]
    if missing:
        return ("missing " + ", ".join(missing) +
                " (apt-get install slurmctld slurmd slurm-client munge iproute2 util-linux)")
    return None


def _run(*cmd: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, **kwargs)


def _query(*cmd: str, env: dict, attempts: int = 5) -> str:
    """stdout of a read-only client command (``scontrol show``, ``sinfo``),
    retried: under load slurmctld may drop a connection mid-reply, and the
    client then dies (seen: ``scontrol`` killed by SIGPIPE). The last failure
    is raised (subprocess.CalledProcessError)."""
    for attempt in range(attempts):
        try:
            return _run(*cmd, env=env).stdout
        except subprocess.CalledProcessError:
            if attempt == attempts - 1:
                raise
            time.sleep(1.0)
    raise AssertionError("unreachable")


def _process_id(pid: int) -> str:
    """"<pid>:<start time in clock ticks after boot>" (/proc/PID/stat, field
    22): names one process for good, where a pid may be reused; "" if none."""
    try:
        return f"{pid}:{(Path('/proc') / str(pid) / 'stat').read_text().rsplit(')', 1)[1].split()[19]}"
    except (OSError, IndexError):
        return ""


def _delete_namespace(node: str) -> None:
    """SIGKILL every process in network namespace ``node``, then delete it."""
    for pid in _run("ip", "netns", "pids", node, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:  # ended since it was listed
            pass
    _run("ip", "netns", "delete", node)


def _environments() -> list[tuple[int, dict]]:
    """(pid, environment) of every live process but this one (zombies and
    processes that are gone or not ours to read left out)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            raw = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            pairs = (item.decode(errors="replace").partition("=") for item in raw if b"=" in item)
            found.append((int(entry.name), {key: value for key, _, value in pairs}))
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class SlurmCluster:
    """Start with ``start()``, always end with ``stop()``.

    ``env`` is the environment for client commands (``sbatch``, ``scontrol``):
    it points SLURM_CONF at this cluster's configuration, so the machine's own
    /etc/slurm is never read or changed. Jobs inherit it (sbatch exports the
    submitting environment), so ``scontrol`` inside a job reaches this cluster.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.hostname = socket.gethostname()
        self.conf = self.root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf), **{OWNER_VAR: _process_id(os.getpid())})
        self._daemons: list[subprocess.Popen] = []
        self._pidfiles: list[Path] = []
        self._netns_made: list[str] = []
        self._bridge_made = False
        self._hosts_added = False

    # ------------------------------------------------------------------ set-up

    def start(self, timeout_s: float = 60) -> None:
        """Start munged, the network namespaces, slurmctld and the slurmds;
        return when all three nodes are idle. Raises RuntimeError (with the
        daemons' logs) on failure, after stopping what it started; raises
        RuntimeError at once when another live test session runs a cluster."""
        self._clear_earlier_session()
        try:
            self._write_config()
            self._start_munge()
            self._make_network()
            self._start(["slurmctld", "-D", "-f", str(self.conf)], "slurmctld")
            self._start(["slurmd", "-D", "-f", str(self.conf), "-N", self.hostname], "slurmd-local")
            for node in {**NETNS_NODES, **STOP_NODES}:
                self._start_slurmd(node, f"slurmd-{node}")
            self._wait_idle(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _write_config(self) -> None:
        for sub in ("state", "spool", "log", "gres", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        gres_lines = ["AutoDetect=off"]
        for node in (self.hostname, *NETNS_NODES, *STOP_NODES):
            files = []
            for index in range(STOP_NODE_SIZE if node in STOP_NODES else GPUS_PER_NODE):
                path = self.root / "gres" / f"{node}-gpu{index}"
                path.touch()  # slurmd warns these are not devices; the node still goes idle
                files.append(str(path))
            # One line per file: a range like gpu[0-1] would need device names.
            gres_lines += [f"NodeName={node} Name=gpu File={file}" for file in files]
        (self.root / "gres.conf").write_text("\n".join(gres_lines) + "\n")
        ctld_port, slurmd_port = _free_port(), _free_port()
        cpus = CPUS_PER_NODE
        nodes = [f"NodeName={self.hostname} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=4096 "
                 f"Gres=gpu:{GPUS_PER_NODE} "
                 f"State=UNKNOWN"]
        nodes += [f"NodeName={node} NodeAddr={addr} CPUs={cpus} RealMemory=4096 "
                  f"Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN"
                  for node, addr in NETNS_NODES.items()]
        nodes += [f"NodeName={node} NodeAddr={addr} CPUs={STOP_NODE_SIZE} RealMemory=4096 "
                  f"Gres=gpu:{STOP_NODE_SIZE} State=UNKNOWN" for node, addr in STOP_NODES.items()]
        stop_nodes = ",".join(STOP_NODES)
        grace_nodes = ",".join(node for node in STOP_NODES if node not in NOGRACE_NODES)
        config = f"""\
ClusterName=ddptest
SlurmctldHost={self.hostname}({BRIDGE_ADDR})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={self.root / 'munge' / 'munge.socket'}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={self.root / 'state'}
SlurmdSpoolDir={self.root / 'spool'}/%n
SlurmctldPidFile={self.root / 'slurmctld.pid'}
SlurmdPidFile={self.root / 'spool'}/slurmd-%n.pid
SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}
SlurmdLogFile={self.root / 'log'}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
ReturnToService=2
SlurmdParameters=config_overrides
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
MinJobAge=3600
KillWait={KILL_WAIT_S}
{chr(10).join(nodes)}
PartitionName=single Nodes={self.hostname} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
PartitionName=multi Nodes={','.join(NETNS_NODES)} MaxTime=INFINITE State=UP OverSubscribe=YES
PartitionName=stops Nodes={grace_nodes} MaxTime=INFINITE State=UP PriorityTier=1 GraceTime={GRACE_TIME_S}
PartitionName=nograce Nodes={','.join(NOGRACE_NODES)} MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=0
PartitionName=urgent Nodes={stop_nodes} MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
"""
        self.conf.write_text(config)

    def _start_munge(self) -> None:
        munge = self.root / "munge"
        key = munge / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        munge.chmod(0o700)
        _run("munged", f"--socket={munge / 'munge.socket'}", f"--key-file={key}",
             f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
             f"--seed-file={munge / 'munged.seed'}", "--force", env=self.env)
        self._pidfiles.append(munge / "munged.pid")

    def _clear_earlier_session(self) -> None:
        """Remove what a killed earlier test session left on this machine:
        its processes (found by OWNER_VAR, whose session is gone), then this
        harness's namespaces, bridge and /etc/hosts lines. Raises RuntimeError
        if the owning session is alive, touching nothing."""
        orphans, owners = [], set()
        for pid, environ in _environments():
            owner = environ.get(OWNER_VAR)
            if owner is None or owner == self.env[OWNER_VAR]:
                continue
            if _process_id(int(owner.split(":")[0])) == owner:
                owners.add(owner.split(":")[0])
            else:
                orphans.append(pid)
        if owners:
            raise RuntimeError(f"another test session (pid {', '.join(sorted(owners))}) runs a Slurm test "
                               "cluster on this machine; wait for it to end, or stop it, and run again")
        found = [f"{len(orphans)} processes"] if orphans else []
        for pid in orphans:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        namespaces = _run("ip", "netns", "list", check=False).stdout.split()
        for node in {**NETNS_NODES, **STOP_NODES}:
            if node in namespaces:
                _delete_namespace(node)
                found.append(f"namespace {node}")
        if _run("ip", "link", "show", BRIDGE, check=False).returncode == 0:
            _run("ip", "link", "delete", BRIDGE)
            found.append(f"bridge {BRIDGE}")
        if any(HOSTS_MARK in line for line in open("/etc/hosts")):
            self._remove_hosts_lines()
            found.append("/etc/hosts lines")
        if found:
            print("removed what a killed earlier test session left: " + ", ".join(found), flush=True)

    def _make_network(self) -> None:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        self._bridge_made = True
        _run("ip", "addr", "add", f"{BRIDGE_ADDR}/24", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        for index, (node, addr) in enumerate({**NETNS_NODES, **STOP_NODES}.items(), start=1):
            _run("ip", "netns", "add", node)
            self._netns_made.append(node)
            _run("ip", "link", "add", f"ddpv{index}", "type", "veth", "peer", "name", NODE_IFACE,
                 "netns", node)
            _run("ip", "link", "set", f"ddpv{index}", "master", BRIDGE)
            _run("ip", "link", "set", f"ddpv{index}", "up")
            _run("ip", "-n", node, "addr", "add", f"{addr}/24", "dev", NODE_IFACE)
            _run("ip", "-n", node, "link", "set", NODE_IFACE, "up")
            _run("ip", "-n", node, "link", "set", "lo", "up")
        with open("/etc/hosts", "a") as hosts:
            self._hosts_added = True
            for node, addr in {**NETNS_NODES, **STOP_NODES}.items():
                hosts.write(f"{addr} {node} {HOSTS_MARK}\n")

    def _start(self, cmd: list[str], name: str) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "w")
        self._daemons.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                              env=self.env, start_new_session=True))

    def _start_slurmd(self, node: str, name: str) -> None:
        """Namespace host ``node``'s slurmd: a network namespace for the
        address, a UTS namespace for the hostname; jobs started by this
        slurmd inherit both. Its output goes to log/``name``.stdout."""
        self._start(["nsenter", f"--net=/var/run/netns/{node}", "unshare", "--uts", "sh", "-c",
                     f'hostname {node} && exec slurmd -D -f "$0" -N {node}', str(self.conf)], name)

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        states = ""
        while time.monotonic() < deadline:
            for daemon in self._daemons:
                if daemon.poll() is not None:
                    raise RuntimeError(f"{daemon.args[0]} exited ({daemon.returncode}):\n{self.logs()}")
            try:
                states = self.node_states()
            except subprocess.CalledProcessError:  # the controller is not answering yet
                states = {}
            if len(states) == 1 + len(NETNS_NODES) + len(STOP_NODES) and set(states.values()) == {"idle"}:
                return
            time.sleep(0.5)
        raise RuntimeError(f"nodes not idle after {timeout_s} s: {states!r}\n{self.logs()}")

    # ------------------------------------------------------------------ use

    def sbatch(self, args: list[str], cwd: Path, env: Optional[dict] = None) -> int:
        """Submit ``sbatch <args>`` from ``cwd``; return the job id."""
        result = _run("sbatch", "--parsable", *args, cwd=cwd, env=dict(self.env, **(env or {})),
                      check=False)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch failed: {result.stderr.strip()}")
        return int(result.stdout.strip().split(";")[0])

    def node_states(self) -> dict:
        """{node name: sinfo's short state}, e.g. ``idle``, ``alloc``, ``comp``."""
        text = _query("sinfo", "-h", "-N", "-o", "%N %t", env=self.env)
        return dict(line.split() for line in text.splitlines())

    def job(self, job_id: int) -> dict:
        """``scontrol show job`` as a dict (JobState, Restarts, NodeList, ExitCode, ...)."""
        text = _query("scontrol", "-o", "show", "job", str(job_id), env=self.env)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: int, timeout_s: float, states=("COMPLETED", "FAILED", "CANCELLED",
                                                          "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")) -> dict:
        """Poll until the job reaches one of ``states``; return its record.
        Raises TimeoutError (job cancelled first) after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        _run("scancel", str(job_id), check=False, env=self.env)
        raise TimeoutError(f"job {job_id} still {self.job(job_id).get('JobState')} after "
                           f"{timeout_s} s\n{self.logs()}")

    @staticmethod
    def on_host(node: str, cmd: list[str]) -> list[str]:
        """``cmd`` wrapped to run on namespace host ``node`` (its address and
        hostname), without Slurm: for plain torchrun across the two hosts."""
        return ["nsenter", f"--net=/var/run/netns/{node}", "unshare", "--uts", "sh", "-c",
                f'hostname {node} && exec "$@"', "sh", *cmd]

    @contextlib.contextmanager
    def configured(self, *lines: str) -> Iterator[None]:
        """Within the ``with``: ``lines`` added to slurm.conf (a later line
        overrides an earlier one), read by slurmctld and the slurmds
        (``scontrol reconfigure``); the file as it was afterwards, read again.
        Cluster-wide: for a test whose job is the only one running."""
        config = self.conf.read_text()
        self.conf.write_text(config + "".join(f"{line}\n" for line in lines))
        try:
            _run("scontrol", "reconfigure", env=self.env)
            yield
        finally:
            self.conf.write_text(config)
            _run("scontrol", "reconfigure", env=self.env)

    def kill_node(self, node: str) -> list[int]:
        """Namespace host ``node`` dies: SIGKILL to every process on it, its
        slurmd, the jobs' slurmstepd and their tasks (its network stays up, so
        the others see their connections to it reset). Slurm learns it only
        when the node stops answering its pings (``SlurmdTimeout``). Returns
        the pids killed; ``revive_node`` starts its slurmd again."""
        killed = []
        for pid in _run("ip", "netns", "pids", node, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
                killed.append(int(pid))
            except ProcessLookupError:  # ended since it was listed
                pass
        return killed

    def revive_node(self, node: str, timeout_s: float = 60) -> None:
        """Start namespace host ``node``'s slurmd again (after ``kill_node``)
        and wait until the node is idle (``ReturnToService=2`` returns a node
        that was down for not answering once its slurmd registers). Raises
        RuntimeError with the daemons' logs when it is not idle in time."""
        self._start_slurmd(node, f"slurmd-{node}-revived")
        deadline = time.monotonic() + timeout_s
        while self.node_states().get(node) != "idle":
            if time.monotonic() > deadline:
                raise RuntimeError(f"{node} not idle {timeout_s} s after its slurmd restarted: "
                                   f"{self.node_states()!r}\n{self.logs()}")
            time.sleep(0.5)

    def logs(self, tail: int = 30) -> str:
        """The last lines of every daemon log, for failure messages."""
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    # ------------------------------------------------------------------ tear-down

    def stop(self) -> None:
        """Stop every daemon and job process, remove namespaces, bridge and hosts
        lines. Each step runs even when an earlier one failed; the first error
        is raised at the end."""
        errors: list[BaseException] = []

        def step(action: Callable[[], object]) -> None:
            try:
                action()
            except Exception as exc:  # noqa: BLE001 - keep cleaning, report later
                errors.append(exc)

        if self.conf.exists():
            step(lambda: _run("scancel", "--full", "--user=root", check=False, env=self.env, timeout=30))
        for daemon in self._daemons:
            step(lambda daemon=daemon: daemon.poll() is None and os.killpg(daemon.pid, signal.SIGTERM))
        for daemon in self._daemons:
            step(lambda daemon=daemon: self._reap(daemon))
        for pidfile in self._pidfiles:
            step(lambda pidfile=pidfile: os.kill(int(pidfile.read_text().strip()), signal.SIGTERM))
        # Whatever is left of this cluster, jobs included: every process that has
        # this cluster's SLURM_CONF in its environment (slurmstepd and the jobs'
        # processes inherit it), and nothing of any other cluster.
        step(lambda: [os.kill(pid, signal.SIGKILL) for pid in self._processes()])
        for node in list(self._netns_made):
            step(lambda node=node: _delete_namespace(node))
            self._netns_made.remove(node)
        if self._bridge_made:
            step(lambda: _run("ip", "link", "delete", BRIDGE))
            self._bridge_made = False
        if self._hosts_added:
            step(self._remove_hosts_lines)
            self._hosts_added = False
        if errors:
            raise errors[0]

    @staticmethod
    def _reap(daemon: subprocess.Popen) -> None:
        try:
            daemon.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()

    @staticmethod
    def _remove_hosts_lines() -> None:
        with open("/etc/hosts") as hosts:
            kept = [line for line in hosts if HOSTS_MARK not in line]
        with open("/etc/hosts", "w") as hosts:  # in place: /etc/hosts may be a bind mount
            hosts.writelines(kept)

    def _processes(self) -> list[int]:
        """Pids of live processes started for this cluster (found by SLURM_CONF)."""
        return [pid for pid, environ in _environments() if environ.get("SLURM_CONF") == str(self.conf)]

    def leftovers(self) -> list[str]:
        """What of this cluster is still there (after ``stop()``: should be nothing)."""
        found = [f"process {pid}" for pid in self._processes()]
        namespaces = _run("ip", "netns", "list", check=False).stdout
        found += [f"network namespace {node}" for node in {**NETNS_NODES, **STOP_NODES}
                  if node in namespaces.split()]
        if _run("ip", "link", "show", BRIDGE, check=False).returncode == 0:
            found.append(f"bridge {BRIDGE}")
        found += [f"/etc/hosts: {line.strip()}" for line in open("/etc/hosts") if HOSTS_MARK in line]
        return found


if __name__ == "__main__":
    import tempfile

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"cannot start a cluster: {reason}")
    with tempfile.TemporaryDirectory() as tmp:
        cluster = SlurmCluster(Path(tmp))
        try:
            start = time.monotonic()
            cluster.start()
            print(f"cluster up in {time.monotonic() - start:.1f} s")
            print(_run("sinfo", "-N", "-o", "%N %P %t %G", env=cluster.env).stdout)
        finally:
            cluster.stop()
            print("left behind:", cluster.leftovers() or "nothing")
