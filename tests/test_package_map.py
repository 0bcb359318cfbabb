"""The kit's shape, read from the source with ast: train_utils is train.py's
library, filed by role in wings (``WINGS``) behind their faces, with a few
modules at its top; every import arrow between them runs down the map
(``ROOMS``, bottom up), none past a wing's face, and no module imports
another in a circle (function-level imports counted); its face exports with
``__all__`` exactly what train.py uses; neither reads a test variable or
holds a test hook (the tests inject faults from their side,
tests/train_with_fault.py), W&B is reached only through the run log, and the
ladder's rungs never import train_utils."""

import ast

from helpers import REPO

PACKAGE = REPO / "train_utils"
RUNGS = ["singlegpu.py", "multigpu_spawn.py", "multigpu_torchrun.py", "multinode.py", "multinode_fsdp.py"]

# The map: each wing's modules (a wing is a folder, its face its __init__.py), and the modules at the top.
WINGS = {
    "distributed": ["devices", "fsdp", "hang_report", "kernels", "launch", "meta_build", "rendezvous", "timeouts"],
    "loop": ["epoch", "evaluation", "evaluations", "links", "loaders", "notice", "numerics", "phases", "progress", "recipe",
             "sampler", "speed", "stop", "stragglers"],
    "logs": ["goodput", "metrics", "profiling", "startup", "text_out", "throughput", "timeline", "wandb_run"],
    "snapshots": ["bucket", "checkpointer", "claims", "file", "position", "save_errors", "sharded", "weights",
                  "writer"],
}
TOP = ["checks", "cli", "config", "ending", "errors", "output", "plan"]
# The rooms from the ground up: a module imports only from rooms below its own (or its own wing's modules).
ROOMS = ["config", "output", "distributed", "snapshots", "ending", "loop", "logs", "checks", "errors", "cli",
         "plan", "__init__"]


def module_paths() -> dict:
    """{module name: its file}: "config", "loop/stop", a wing's face "loop/__init__", the package's "__init__"."""
    return {path.relative_to(PACKAGE).with_suffix("").as_posix(): path for path in sorted(PACKAGE.rglob("*.py"))}


MODULES = sorted(module_paths())


def room(module: str) -> str:
    """The wing a module belongs to (its folder), or the module itself at the top."""
    return module.split("/")[0]


def tree(path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _target(parts: list) -> str:
    """The package's module that the dotted path ``parts`` (below train_utils) names: a file, or a folder's face."""
    name = "/".join(parts) or "__init__"
    return name if name in MODULES else f"{name}/__init__"


def imported_modules(module: str) -> set:
    """The train_utils modules ``module`` imports, anywhere in it (inside
    functions too): a wing's face where it imports from the wing's folder."""
    package = module.split("/")[:-1]  # the folder it is in, below train_utils
    found = set()
    for node in ast.walk(tree(module_paths()[module])):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - (node.level - 1)]
            if node.module:
                found.add(_target(base + node.module.split(".")))
            else:  # from . import hang_report
                found |= {_target(base + [alias.name]) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("train_utils"):
            parts = node.module.split(".")[1:]
            found |= {_target(parts)} if parts else {_target([alias.name]) for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {_target(alias.name.split(".")[1:]) for alias in node.names
                      if alias.name.startswith("train_utils.")}
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


def test_the_wings_hold_their_modules_and_the_top_a_few():
    """The map above is the package's: each wing's modules, the modules at the top."""
    found = {wing: sorted(m.split("/")[1] for m in MODULES if room(m) == wing and not m.endswith("__init__"))
             for wing in WINGS}
    assert found == WINGS
    assert sorted(m for m in MODULES if "/" not in m and m != "__init__") == TOP
    assert sorted(room(m) for m in MODULES if m.endswith("/__init__")) == sorted(WINGS)  # each wing has a face


def test_every_import_runs_down_the_map_and_through_a_wings_face():
    """An arrow between rooms runs from a higher room to a lower one
    (``ROOMS``): none back up; and from outside a wing it reaches the wing's
    face, never a module behind it."""
    up, past = [], []
    for module in MODULES:
        for other in imported_modules(module):
            if room(other) == room(module):
                continue
            if ROOMS.index(room(other)) > ROOMS.index(room(module)):
                up.append(f"{module} -> {other}")
            if room(other) in WINGS and other != f"{room(other)}/__init__":
                past.append(f"{module} -> {other}")
    assert up == [] and past == []


def test_the_programs_stand_beside_train_py_not_in_the_library():
    """The programs that use the kit (tools/: the resume check, the run's
    identity, the export to Hugging Face) are files beside train.py; no
    module of train_utils imports them, nor train.py."""
    assert sorted(path.name for path in (REPO / "tools").glob("*.py")) == ["check_resume.py", "export_hf.py",
                                                                          "identity.py"]
    importing = [module for module in MODULES for node in ast.walk(tree(module_paths()[module]))
                 if isinstance(node, (ast.Import, ast.ImportFrom))
                 and any(name.split(".")[0] in ("tools", "train") for name in
                         [alias.name for alias in node.names] + [getattr(node, "module", None) or ""])]
    assert importing == []


def test_the_map_reader_sees_every_form_of_import():
    """``imported_modules`` resolves relative imports from a wing (one and two
    dots, a sibling module by name) and absolute ones to the modules named."""
    assert "loop/stop" in imported_modules("loop/speed")  # from .stop import STOP_SIGNALS
    assert "distributed/hang_report" in imported_modules("distributed/timeouts")  # from . import hang_report
    assert "snapshots/__init__" in imported_modules("loop/progress")  # from ..snapshots import position
    assert "config" in imported_modules("checks")  # from .config import RunConfig


def exported() -> list:
    """The names in train_utils/__init__.py's ``__all__``."""
    for node in tree(PACKAGE / "__init__.py").body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("train_utils/__init__.py has no __all__")


def used_by_train_py() -> set:
    """Each NAME train.py uses as ``train_utils.NAME`` (read with ast)."""
    return {node.attr for node in ast.walk(tree(REPO / "train.py"))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "train_utils"}


def test_the_face_exports_what_train_py_uses():
    """``__all__`` is exactly what train.py uses as ``train_utils.NAME``, both
    ways (the tests and benchmarks import the rest from its module); each name
    exists, and ``__all__`` names everything the package imports into its face."""
    import train_utils

    names = exported()
    assert len(names) == len(set(names))
    assert [name for name in names if not hasattr(train_utils, name)] == []
    face = {alias.asname or alias.name for node in tree(PACKAGE / "__init__.py").body
            if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert sorted(face - set(names)) == []
    used = used_by_train_py()
    assert sorted(set(names) - used) == []  # exported, yet train.py does not use it
    assert sorted(used - set(names)) == []  # train.py uses it, yet the face does not export it


KIT = [REPO / "train.py", *sorted(PACKAGE.rglob("*.py")), *sorted((REPO / "tools").glob("*.py"))]


def environment_names(path) -> set:
    """The environment variables ``path`` reads by name: the string keys of
    ``os.environ[...]``, ``os.environ.get(...)``, ``os.getenv(...)`` and
    ``... in os.environ``."""

    def is_environ(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    names = set()
    for node in ast.walk(tree(path)):
        keys = []
        if isinstance(node, ast.Subscript) and is_environ(node.value):
            keys = [node.slice]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args and (
                node.func.attr == "getenv" or node.func.attr == "get" and is_environ(node.func.value)):
            keys = [node.args[0]]
        elif isinstance(node, ast.Compare) and any(is_environ(other) for other in node.comparators):
            keys = [node.left]
        names |= {key.value for key in keys if isinstance(key, ast.Constant) and isinstance(key.value, str)}
    return names


def test_the_kit_reads_no_test_variable_and_has_no_test_hook():
    """train.py and train_utils neither read a test's environment variable
    (DDP_TEST_FAULT, or any other TEST one) nor hold a hook for the tests: no
    ``testing`` module, no ``fault_point``, no "DDP_TEST" anywhere in their
    text. The tests inject faults from their side (tests/train_with_fault.py
    patches the kit's functions)."""
    assert [path for path in PACKAGE.rglob("testing.py")] == []
    read = {f"{path.name}: {name}" for path in KIT for name in environment_names(path) if "TEST" in name.upper()}
    assert read == set()
    hooks = {f"{path.name}: {word}" for path in KIT for word in ("DDP_TEST", "fault_point", "train_with_fault")
             if word in path.read_text()}
    assert hooks == set()
    imports_testing = [path.name for path in KIT for node in ast.walk(tree(path))
                       if isinstance(node, (ast.Import, ast.ImportFrom))
                       and any("testing" in name.split(".") for name in
                               [alias.name for alias in node.names] + [getattr(node, "module", None) or ""])]
    assert imports_testing == []


def test_environment_names_finds_every_way_of_reading_a_variable(tmp_path):
    """The reader above sees each form a module might read DDP_TEST_FAULT with."""
    for line in ('os.environ.get("DDP_TEST_FAULT")', 'os.environ["DDP_TEST_FAULT"]',
                 'os.getenv("DDP_TEST_FAULT", "")', '"DDP_TEST_FAULT" in os.environ'):
        source = tmp_path / "module.py"
        source.write_text(f"import os\nvalue = {line}\n")
        assert environment_names(source) == {"DDP_TEST_FAULT"}, line


def test_wandb_is_reached_only_through_the_run_log():
    """W&B is where a run starts, logs and ends: metrics.RunLog, which train.py
    makes, starts and closes; no other module imports wandb_run."""
    assert [module for module in MODULES if "logs/wandb_run" in imported_modules(module)] == ["logs/metrics"]


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


def test_the_character_task_needs_no_token_file_code():
    """A rung trains --dataset shakespeare_char with common.py, recipes.py,
    text_tasks.py and gpt.py beside it: of the repository's modules,
    text_tasks and gpt import common and each other only, never the token
    files' task (token_tasks.py, which builds on text_tasks)."""
    ours = {path.stem for path in REPO.glob("*.py")}

    def imports(module: str) -> set:
        found = set()
        for node in ast.walk(tree(REPO / f"{module}.py")):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found.add((node.module or "").split(".")[0])
        return found & ours - {module}

    assert imports("text_tasks") == {"common", "gpt"} and imports("gpt") == {"common"}
    assert "text_tasks" in imports("token_tasks")
