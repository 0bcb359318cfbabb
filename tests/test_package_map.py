"""The kit's shape, read from the source with ast: train_utils is train.py's
library of modules without import circles (function-level imports
counted), its face exports with ``__all__`` what train.py and the tests use, the tests' fault
hook is called from train.py only, W&B is reached only through the run log,
and the ladder's rungs never import train_utils."""

import ast
import re

from helpers import REPO

PACKAGE = REPO / "train_utils"
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
RUNGS = ["singlegpu.py", "multigpu_spawn.py", "multigpu_torchrun.py", "multinode.py", "multinode_fsdp.py"]


def tree(path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def imported_modules(module: str) -> set:
    """The train_utils modules ``module`` imports, anywhere in it (inside functions too)."""
    found = set()
    for node in ast.walk(tree(PACKAGE / f"{module}.py")):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module.split(".")[0]} if node.module else {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("train_utils."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("train_utils.")}
    return found & set(MODULES) - {module}


def circles(graph: dict) -> list:
    """Each import circle of ``graph`` (module -> modules it imports) as the
    path that closes it, e.g. ["a", "b", "a"]; [] when there is none."""
    found, done = [], set()

    def visit(module, path):
        if module in path:
            found.append(path[path.index(module):] + [module])
            return
        if module in done:
            return
        for other in sorted(graph[module]):
            visit(other, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return found


def test_circles_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_train_utils_has_no_import_circles():
    assert circles({module: imported_modules(module) for module in MODULES}) == []


def exported() -> list:
    """The names in train_utils/__init__.py's ``__all__``."""
    for node in tree(PACKAGE / "__init__.py").body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("train_utils/__init__.py has no __all__")


def test_the_face_exports_what_train_py_and_the_tests_use():
    """``__all__`` names everything the package imports into its face, each name
    exists, and each is used by train.py, the tests or the benchmarks."""
    import train_utils

    names = exported()
    assert len(names) == len(set(names))
    assert [name for name in names if not hasattr(train_utils, name)] == []
    face = {alias.asname or alias.name for node in tree(PACKAGE / "__init__.py").body
            if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert sorted(face - set(names)) == []
    users = [REPO / "train.py", *(REPO / "tests").glob("*.py"), *(REPO / "benchmarks").glob("*.py")]
    text = "\n".join(path.read_text() for path in users if path.name != "test_package_map.py")
    assert [name for name in names if not re.search(rf"\btrain_utils\.{name}\b", text)] == []


def test_the_fault_hook_is_called_from_train_py_only():
    """No module of train_utils imports the tests' hook, so no collective path
    of the library holds one; train.py calls it at the points the tests use."""
    assert [module for module in MODULES if "testing" in imported_modules(module)] == []
    calls = set(re.findall(r"fault_point\(\"(\w+)\"\)", (REPO / "train.py").read_text()))
    assert calls == {"startup", "step", "save", "finished"}


def test_wandb_is_reached_only_through_the_run_log():
    """W&B is where a run starts, logs and ends: metrics.RunLog, which train.py
    makes, starts and closes; no other module imports wandb_run."""
    assert [module for module in MODULES if "wandb_run" in imported_modules(module)] == ["metrics"]


def test_the_rungs_never_import_train_utils():
    """The ladder's rungs are standalone: torch, torchvision, tqdm and the task
    modules; train_utils is the kit's (train.py's) only."""
    importing = []
    for rung in RUNGS:
        for node in ast.walk(tree(REPO / rung)):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(name.split(".")[0] == "train_utils" for name in names):
                importing.append(rung)
    assert importing == []
