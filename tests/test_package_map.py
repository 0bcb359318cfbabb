"""The machinery's shape: train_utils is a package of small modules, its
``__init__`` docstring is the map of them, and the first rung reaches none of
the distributed machinery through the calls it makes."""

import ast
import re
import subprocess
import sys

from helpers import REPO

PACKAGE = REPO / "train_utils"
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
MOST_LINES = 250
# A row of the map: module, concern, then (after two spaces) the first rung.
RUNG = r"^  (\w+) +.*  (singlegpu|spawn|torchrun|FSDP|tests only)\b"


def test_every_module_is_small():
    sizes = {name: len((PACKAGE / f"{name}.py").read_text().splitlines()) for name in MODULES}
    assert {name: n for name, n in sizes.items() if n > MOST_LINES} == {}


def test_the_map_names_every_module_and_its_first_rung():
    doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text()))
    rows = dict(re.findall(RUNG, doc, re.M))
    assert sorted(rows) == MODULES


def test_the_map_says_what_each_script_reaches():
    """Each script's ``train_utils.NAME`` calls come from modules that the map
    lists for that rung or an earlier one."""
    order = ["singlegpu", "spawn", "torchrun", "FSDP"]
    doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text()))
    first = {name: rung for name, rung in
             re.findall(RUNG, doc, re.M)}
    sys.path.insert(0, str(REPO))
    import train_utils

    for script, rung in [("singlegpu.py", "singlegpu"), ("multigpu_spawn.py", "spawn"),
                         ("multigpu_torchrun.py", "torchrun"), ("multinode.py", "torchrun"),
                         ("multinode_fsdp.py", "FSDP")]:
        names = set(re.findall(r"train_utils\.(\w+)", (REPO / script).read_text()))
        for name in names:
            module = getattr(train_utils, name).__module__.split(".")[-1] \
                if hasattr(getattr(train_utils, name), "__module__") else None
            if module in first:  # constants have no module of their own
                assert order.index(first[module]) <= order.index(rung), (script, name, module)


# Run singlegpu.py with the distributed machinery replaced by functions that
# fail loudly: process-group collectives, the time-out watch, the stop signal.
FORBIDDEN = """
import runpy, sys
import torch.distributed as dist
import train_utils

def forbid(name):
    def call(*args, **kwargs):
        raise AssertionError(f"singlegpu.py reached {name}")
    return call

for name in ("init_process_group", "new_group", "barrier", "all_reduce", "all_gather_object",
             "broadcast", "broadcast_object_list", "monitored_barrier"):
    setattr(dist, name, forbid("torch.distributed." + name))
for module in list(sys.modules.values()):
    if getattr(module, "__name__", "").startswith("train_utils"):
        for name in ("note_phase", "use_training_timeout", "watch_collectives", "timeout_diagnosis",
                     "gloo_group", "StopSignal", "launcher_store"):
            if hasattr(module, name):
                setattr(module, name, forbid("train_utils." + name))
sys.argv = ["singlegpu.py"] + sys.argv[1:]
runpy.run_path("singlegpu.py", run_name="__main__")
"""


def test_singlegpu_reaches_no_distributed_machinery(tmp_path):
    result = subprocess.run([sys.executable, "-c", FORBIDDEN, "--total_epochs", "1",
                             "--checkpoint_path", str(tmp_path / "c.pt")],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "test | loss" in result.stdout
