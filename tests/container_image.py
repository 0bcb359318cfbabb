"""The container test's image: the repository's Dockerfile built with rootful
podman on a Debian base made by debootstrap, all of podman's state in one
folder. The base carries torch, as the Dockerfile's default base (an official
PyTorch image) does: the distributions requirements.txt needs, copied from
the test environment where its Python is the base's (else the build
installs them from the package index, as on a plain Python base). Standard
library only, so that .ci/run can start the build with the system's python3
before the test environment exists:

    python3 tests/container_image.py ROOT [PYTHON]    # builds into ROOT/podman, writes ROOT/result.json

(PYTHON: the test environment's interpreter, whose packages the base takes
once its installation is complete; it is waited for.) The test
(tests/test_container.py) takes the image from there when
DDP_TEST_IMAGE_ROOT names ROOT, or builds it itself.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
# Where .ci/run builds the image in the background (unset: the test builds it).
PREBUILT_VAR = "DDP_TEST_IMAGE_ROOT"
TOOLS = ("podman", "runc", "debootstrap")
APT_SOURCES = Path("/etc/apt/sources.list.d")
APT_SOURCES_LIST = Path("/etc/apt/sources.list")
# The host's CA bundle: pip inside the build needs it behind a TLS-intercepting
# proxy (mounted for the build only, never part of the image).
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
BASE_TAG = "localhost/ddp-test-base:latest"
IMAGE_TAG = "localhost/ddp-scripts:test"
BUILD_TIMEOUT_S = 1200
# Measured peak of the build, about 23 GB: the container's 6 GB of packages,
# the layer blob made from them and the new layer, all at once while it commits.
DISK_NEEDED = 26e9
RUN_TIMEOUT_S = 600
# State that rootful podman keeps at fixed places, whatever its settings: the
# network run folder (netavark's, empty with the host network) and the blob
# digest cache of image copies. Removed after the test where it created them.
PODMAN_SYSTEM_STATE = {Path("/run/containers/networks"): (),
                       Path("/var/lib/containers/cache"): ("blob-info-cache-v1.boltdb",)}
def _tool(name: str) -> Optional[str]:
    """The path of a program, looking in the sbin folders too (podman finds
    runc there even when PATH lacks them)."""
    return shutil.which(name) or shutil.which(name, path="/usr/local/sbin:/usr/sbin:/sbin")


def debian_mirror() -> Optional[tuple[str, str]]:
    """(mirror URL, suite) of the Debian archive apt uses on this machine, read
    from its sources (deb822 ``*.sources`` or one-line ``sources.list``), or
    None. The suite is the release's own (no ``-updates``/``-security``)."""
    for path in sorted(APT_SOURCES.glob("*.sources")) if APT_SOURCES.is_dir() else []:
        for stanza in re.split(r"\n\s*\n", path.read_text()):
            fields = dict(re.findall(r"^(\w[\w-]*):[ \t]*(.*)$", stanza, re.M))
            suites = [s for s in fields.get("Suites", "").split() if "-" not in s and "/" not in s]
            uris = fields.get("URIs", "").split()
            if "deb" in fields.get("Types", "").split() and suites and uris \
                    and fields.get("Enabled", "yes") != "no":
                return uris[0], suites[0]
    if APT_SOURCES_LIST.is_file():
        for line in APT_SOURCES_LIST.read_text().splitlines():
            m = re.match(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+([^\s/-]+)\s", line)
            if m:
                return m.group(1), m.group(2)
    return None


def unavailable_reason() -> Optional[str]:
    """Why the image cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root (rootful podman, debootstrap)"
    missing = [name for name in TOOLS if _tool(name) is None]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install podman runc debootstrap)"
    if debian_mirror() is None:
        return f"no Debian mirror for debootstrap in {APT_SOURCES}/*.sources or {APT_SOURCES_LIST}"
    return None


class Podman:
    """Rootful podman whose configuration, storage, run and temporary folders
    all lie under ``root``: nothing of it outside, nothing left after
    ``cleanup()``. The settings (docs/containers.md says why): runc (crun
    refuses hybrid cgroups), rlimits root may set, host network, no systemd."""

    def __init__(self, root: Path):
        self.root = root
        for name in ("storage", "run", "libpod", "networks", "tmp"):
            (root / name).mkdir(parents=True, exist_ok=True)
        (root / "containers.conf").write_text(f"""\
[containers]
netns = "host"
default_ulimits = ["nofile=8192:8192", "nproc=8192:8192"]

[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "{root}/libpod/events.log"
image_copy_tmp_dir = "{root}/tmp"
runtime = "runc"
tmp_dir = "{root}/libpod"

[network]
network_config_dir = "{root}/networks"
""")
        (root / "storage.conf").write_text(f"""\
[storage]
driver = "overlay"
graphroot = "{root}/storage"
runroot = "{root}/run"
""")
        # The system folders (and parents) that do not exist yet: cleanup() removes them.
        self.created = [folder for path in PODMAN_SYSTEM_STATE
                        for folder in (path, *path.parents) if not folder.exists()]
        self.env = dict(os.environ, CONTAINERS_CONF=str(root / "containers.conf"),
                        CONTAINERS_STORAGE_CONF=str(root / "storage.conf"), TMPDIR=str(root / "tmp"))

    def __call__(self, *args, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
        """``podman ARGS`` with this instance's settings; output as text."""
        return subprocess.run(["podman", *map(str, args)], env=self.env, capture_output=True,
                              text=True, timeout=timeout, **kwargs)

    def run_cmd(self, image: str, *command, volumes: dict = None, workdir: str = "/workspace",
                env: dict = None) -> list[str]:
        """The ``podman run`` command line for ``command`` in ``image``: host
        network, never a pull, ``volumes`` {host path: container path[:ro]}."""
        cmd = ["podman", "run", "--rm", "--pull=never", "--network=host", f"--workdir={workdir}"]
        for host, inside in (volumes or {}).items():
            cmd.append(f"--volume={host}:{inside}")
        for name, value in (env or {}).items():
            cmd.append(f"--env={name}={value}")
        return cmd + [image, *map(str, command)]

    def run(self, image: str, *command, timeout: float = RUN_TIMEOUT_S, **options) -> subprocess.CompletedProcess:
        """Run ``command`` in a container of ``image`` (``run_cmd``'s options), wait for it."""
        return self(*self.run_cmd(image, *command, **options)[1:], timeout=timeout)

    def cleanup(self) -> subprocess.Popen:
        """Remove the containers, unmount what is still mounted under ``root``
        and start deleting the folder, images and all, in the background (its
        12 GB take tens of seconds the next tests need not wait for); returns
        that ``rm`` process. Each step runs whatever the last did."""
        try:
            self("rm", "--all", "--force", "--time=0", timeout=300)
        except subprocess.TimeoutExpired:
            pass
        for mount_point in reversed(self._mounts()):
            subprocess.run(["umount", "--lazy", mount_point], capture_output=True)
        removing = self.root.with_name(self.root.name + ".removing")
        self.root.rename(removing)  # gone from root at once; the rm may take its time
        remover = subprocess.Popen(["rm", "-rf", "--one-file-system", removing])
        for path, files in PODMAN_SYSTEM_STATE.items():
            if path in self.created:
                for name in files:
                    (path / name).unlink(missing_ok=True)
        for folder in sorted(self.created, key=lambda p: len(p.parts), reverse=True):
            try:
                folder.rmdir()  # only if empty: never what another podman put there since
            except OSError:
                pass
        return remover

    def _mounts(self) -> list[str]:
        with open("/proc/self/mounts") as f:
            points = [line.split()[1].replace("\\040", " ") for line in f]
        return [p for p in points if p == str(self.root) or p.startswith(f"{self.root}/")]

    def leftovers(self) -> list[str]:
        """What ``cleanup()`` failed to remove: mounts under ``root``, the folder,
        system folders podman created."""
        return self._mounts() + [str(p) for p in [self.root, *self.created] if p.exists()]


@dataclass
class Image:
    """The built image and the podman instance that holds it."""
    podman: Podman
    tag: str


def _timed(what: str, function, *args, **kwargs):
    started = time.monotonic()
    result = function(*args, **kwargs)
    print(f"{what}: {time.monotonic() - started:.1f} s")
    return result


def _checked(result: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    assert result.returncode == 0, (
        f"{what} failed (exit {result.returncode})\n--- stdout\n{result.stdout[-4000:]}"
        f"\n--- stderr\n{result.stderr[-4000:]}")
    return result


def _make_base(podman: Podman, rootfs: Path, packages_from: Optional[str] = None) -> None:
    """A Debian + Python base image, no registry: debootstrap from the mirror
    apt uses, the distributions requirements.txt needs from ``packages_from``'s
    environment (``copy_packages``), then podman import; the root file system
    is removed after."""
    mirror, suite = debian_mirror()
    _checked(_timed(f"debootstrap {suite} from {mirror}", subprocess.run,
                    [_tool("debootstrap"), "--variant=minbase", "--include=python3,python3-pip,ca-certificates",
                     suite, rootfs, mirror], capture_output=True, text=True, timeout=900), "debootstrap")
    if packages_from:
        print(_timed("packages", copy_packages, packages_from, rootfs))
    started = time.monotonic()
    tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
    try:
        imported = podman("import", "-", BASE_TAG, stdin=tar.stdout, timeout=600)
    finally:
        tar.stdout.close()
        tar.wait()
    _checked(imported, "podman import")
    print(f"podman import: {time.monotonic() - started:.1f} s")
    shutil.rmtree(rootfs)


# Run by the test environment's Python: every file of the distributions requirements.txt
# names and of what they require there (markers evaluated as pip does), as
# [{"name", "complete": its RECORD is written, "files": [absolute paths]}]; what is missing, by name.
_CLOSURE = r"""
import importlib.metadata as md, json, os, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
wanted, seen, found, missing = [], set(), [], []
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        wanted.append(Requirement(line))
while wanted:
    requirement = wanted.pop()
    name = canonicalize_name(requirement.name)
    if name in seen:
        continue
    seen.add(name)
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        missing.append(name)
        continue
    files = [str(dist.locate_file(f).resolve()) for f in dist.files or []]
    found.append({"name": name, "complete": any(f.endswith(".dist-info/RECORD") and os.path.exists(f)
                                                for f in files), "files": files})
    for text in dist.requires or []:
        needed = Requirement(text)
        if needed.marker is None or needed.marker.evaluate({"extra": ""}):
            wanted.append(needed)
print(json.dumps({"python": "%d.%d" % sys.version_info[:2], "prefix": sys.prefix, "found": found,
                  "missing": missing}))
"""
PACKAGES_WAIT_S = 1200


def copy_packages(python: str, rootfs: Path, wait_s: float = PACKAGES_WAIT_S) -> str:
    """Copy into ``rootfs`` the distributions requirements.txt needs, as the
    environment of ``python`` holds them: its modules into the base Python's
    site folder (/usr/local/lib/python3.X/dist-packages), its scripts
    (torchrun) into /usr/local/bin, started by the base's python3. Waits
    (up to ``wait_s`` seconds) until that environment holds every one of
    them whole (its pip writes a distribution's RECORD last). Copies nothing
    where ``python``'s version is not the base's (the build then installs
    them from the package index). Returns what it did, in a line."""
    base = sorted(p.name for p in (rootfs / "usr" / "lib").glob("python3.*") if (p / "os.py").exists())
    deadline = time.monotonic() + wait_s
    while True:
        probe = subprocess.run([python, "-c", _CLOSURE, str(REPO / "requirements.txt")], capture_output=True,
                               text=True) if os.path.exists(python) else None
        if probe and probe.returncode == 0:
            closure = json.loads(probe.stdout)
            if not closure["missing"] and all(dist["complete"] for dist in closure["found"]):
                break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{python}'s environment did not hold requirements.txt's packages within "
                               f"{wait_s:.0f} s" + (f": {probe.stderr[-500:]}" if probe else ""))
        time.sleep(5)
    if base != [f"python{closure['python']}"]:
        return f"packages: none copied ({python} is Python {closure['python']}, the base's {base})"
    site = rootfs / "usr" / "local" / "lib" / f"python{closure['python']}" / "dist-packages"
    scripts = rootfs / "usr" / "local" / "bin"
    prefix_bin = os.path.join(closure["prefix"], "bin") + os.sep
    copied = 0
    for dist in closure["found"]:
        # With their bytecode (the same Python, the sources' times kept): no container compiles them again.
        compiled = [str(path) for source in dist["files"] if source.endswith(".py")
                    for path in Path(source).parent.glob(f"__pycache__/{Path(source).stem}.*.pyc")]
        for source in dict.fromkeys(dist["files"] + compiled):
            if not os.path.isfile(source):
                continue
            if source.startswith(prefix_bin):  # a console script: its first line names the environment's python
                lines = Path(source).read_bytes().split(b"\n", 1)
                target = scripts / os.path.basename(source)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(b"#!/usr/bin/python3\n" + (lines[1] if len(lines) > 1 else b""))
                target.chmod(0o755)
            elif "site-packages" in Path(source).parts:
                parts = Path(source).parts
                index = max(i for i, part in enumerate(parts) if part == "site-packages")
                target = site.joinpath(*parts[index + 1:])
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)
            else:  # data files outside the site folder (a man page, a header): not needed to run
                continue
            copied += 1
    names = ", ".join(sorted(dist["name"] for dist in closure["found"]))
    return f"packages: {copied} files of {len(closure['found'])} distributions from {python} ({names})"


def build(root: Path, packages_from: Optional[str] = None) -> Image:
    """Build the image into ``root``/podman (a new folder): a debootstrap base
    (with ``packages_from``'s packages: ``copy_packages``), then the
    Dockerfile; prints each step's time and the image's size.
    Raises RuntimeError when the disk lacks DISK_NEEDED bytes, AssertionError
    (with the command's output) when a step fails; the caller cleans up
    (``Podman.cleanup``) either way."""
    free = shutil.disk_usage(root).free
    if free < DISK_NEEDED:
        raise RuntimeError(f"the image build needs about {DISK_NEEDED / 1e9:.0f} GB free disk at its peak; "
                           f"{root} has {free / 1e9:.1f} GB")
    podman = Podman(root / "podman")
    _make_base(podman, root / "rootfs", packages_from)
    command = ["build", "--pull=never", "--network=host", "--file", REPO / "Dockerfile",
               "--build-arg", f"BASE={BASE_TAG}", "--tag", IMAGE_TAG]
    if CA_BUNDLE.is_file():
        command += ["--volume", f"{CA_BUNDLE}:/run/host-ca.crt:ro", "--build-arg", "PIP_CERT=/run/host-ca.crt"]
    built = _timed("podman build", podman, *command, REPO, timeout=BUILD_TIMEOUT_S)
    _checked(built, "podman build")
    size = int(_checked(podman("image", "inspect", "--format", "{{.Size}}", IMAGE_TAG), "inspect").stdout)
    versions = [line for line in built.stdout.splitlines() if line.startswith("torch ")]
    print(f"image {IMAGE_TAG}: {size / 1e9:.2f} GB; {versions[-1] if versions else '?'}", flush=True)
    return Image(podman, IMAGE_TAG)


def prebuilt(root: Path, timeout_s: float = PACKAGES_WAIT_S + BUILD_TIMEOUT_S + 300) -> Image:
    """The image a background ``python3 tests/container_image.py root`` builds:
    waits for its ``result.json``; raises RuntimeError with the build's error
    (or when none came within ``timeout_s`` seconds)."""
    result = root / "result.json"
    deadline = time.monotonic() + timeout_s
    while not result.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no image from the background build in {root} after {timeout_s:.0f} s")
        time.sleep(1)
    outcome = json.loads(result.read_text())
    if not outcome["ok"]:
        raise RuntimeError(f"the background image build in {root} failed: {outcome['error']}")
    print(outcome["log"], end="")
    return Image(Podman(root / "podman"), IMAGE_TAG)


def main(root: Path, packages_from: Optional[str] = None) -> int:
    """Build into ``root`` (``packages_from``: ``build``'s) and write
    ``root``/result.json ({"ok", "error", "log"}: what ``prebuilt`` reads)
    with a rename, so it is whole when seen."""
    import contextlib
    import io

    log = io.StringIO()
    try:
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(f"cannot build the image here: {reason}")
        with contextlib.redirect_stdout(log):
            build(root, packages_from)
        outcome = {"ok": True, "error": "", "log": log.getvalue()}
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "log": log.getvalue()}
    (root / "result.json.tmp").write_text(json.dumps(outcome))
    (root / "result.json.tmp").rename(root / "result.json")
    print(outcome["log"] + (outcome["error"] or "image built"), flush=True)
    return 0 if outcome["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None))
