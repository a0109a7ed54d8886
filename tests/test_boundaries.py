"""The layers, and services that meet only through them (docs/architecture.md):

    contracts (``shared``) -> runtime (``runtime``) and model code (``modeling``, then ``evaluation``)
                           -> services (``services/<name>``) -> the launcher (``services/cli``)

Each layer imports only those before it: ``shared`` imports no other package of the project and no torch;
``runtime`` imports ``shared`` and no torch; ``modeling`` imports ``shared`` and torch; ``evaluation`` imports
``shared``, ``runtime`` and ``modeling``, never a service (training calls evaluation, never the other way round);
a service imports all of those and its own modules, never another service's.

The walk reads every import statement (top-level or inside a function) with ``ast``, so an import that
only runs on some path counts too. ``services/cli`` is exempt: it is the one ``draftline`` command that
starts every service (``draftline serve NAME``) and runs the operator's commands in-process.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SERVICES = ("controller", "generator", "extractor", "trainer", "inference", "exporter")
LAUNCHER = "cli"
HEAVY = ("torch", "safetensors.torch", "transformers")
PACKAGES = ("shared", "runtime", "modeling", "evaluation", "services")
# What each package below the services may import of the project's packages (itself included).
LAYERS = {
    "shared": ("shared",),
    "runtime": ("shared", "runtime"),
    "modeling": ("shared", "modeling"),
    "evaluation": ("shared", "runtime", "modeling", "evaluation"),
}


def imported_modules(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, dotted module) for every import in ``path`` (or in ``source`` as if it were that file);
    relative imports resolved against the file's package."""
    text = path.read_text(encoding="utf-8") if source is None else source
    tree = ast.parse(text, filename=str(path))
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found.append((node.lineno, base))
    return found


def sources(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


def test_every_service_folder_is_known():
    folders = {p.name for p in (REPO / "services").iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert folders == {*SERVICES, LAUNCHER}  # a new service must be added here, and so checked


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_imports_no_other_service(service):
    crossing = []
    for path in sources(f"services/{service}"):
        for line, module in imported_modules(path):
            parts = module.split(".")
            if parts[0] == "services" and (len(parts) < 2 or parts[1] != service):
                crossing.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert crossing == []


def forbidden_imports(folder: str, roots: tuple[str, ...], heavy: bool) -> list[str]:
    """Imports in ``folder`` of a package named in ``roots`` (or of torch and its kin, with ``heavy``)."""
    bad = []
    for path in sources(folder):
        for line, module in imported_modules(path):
            if module.split(".")[0] in roots or (heavy and module.startswith(HEAVY)):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    return bad


def test_every_top_level_package_is_in_a_layer():
    packages = {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()} - {"tests", "bench"}
    assert packages == set(PACKAGES)  # a new package must be given a layer here, and so checked


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_a_layer_imports_only_the_layers_before_it(package):
    above = tuple(p for p in PACKAGES if p not in LAYERS[package])
    assert forbidden_imports(package, above, heavy=package in ("shared", "runtime")) == []


def test_the_rule_finds_a_contract_importing_runtime(tmp_path, monkeypatch):
    # The rule must be able to fail: a contract module that imports the runtime is named.
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "probe.py").write_text("from runtime.worker import run_worker\n")
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    assert forbidden_imports("shared", ("services", "runtime"), heavy=True) == ["shared/probe.py:1 imports runtime.worker"]


def test_the_walk_sees_imports_inside_functions_and_relative_ones():
    # The checker itself must be able to fail: a deferred import and a relative one are both found.
    module = REPO / "services" / "controller" / "probe.py"
    source = "def f():\n    from modeling.export import verify_export\nfrom ..exporter import gpu\n"
    assert sorted(imported_modules(module, source)) == [(2, "modeling.export"), (3, "services.exporter")]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(folders: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (``from a.b import c`` counts as ``a.b.c`` when that is a
    module, else ``a.b``), every import statement included, deferred ones too."""
    modules = {module_name(path): path for folder in folders for path in sources(folder)}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    child = f"{node.module}.{alias.name}"
                    found.add(child if child in modules else node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle as [a, b, ..., a], or [] when there is none (depth-first, colouring nodes)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return []


def test_no_import_circle_among_the_project_modules():
    # A circle means domain code reaches back into a layer above it (preflight into the HTTP API once did).
    assert find_cycle(import_graph(PACKAGES)) == []


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


# The controller's rooms: the API (api/) and the background loop (loop/) both use the run's domain (runs/);
# starting a run never reaches into either, and the loop never into the API. The API assembles the loop.
CONTROLLER_ROOMS = {"runs": ("api", "loop"), "loop": ("api",)}


@pytest.mark.parametrize("room", sorted(CONTROLLER_ROOMS))
def test_controller_rooms_import_only_downwards(room):
    above = tuple(f"services.controller.{name}" for name in CONTROLLER_ROOMS[room])
    reaching = [f"{path.relative_to(REPO)}:{line} imports {module}"
                for path in sources(f"services/controller/{room}")
                for line, module in imported_modules(path) if module.startswith(above)]
    assert reaching == []


def test_controller_modules_live_in_a_room():
    loose = {p.name for p in (REPO / "services" / "controller").glob("*.py")} - {"__init__.py", "main.py"}
    assert loose == set()  # a new module goes into api/, runs/ or loop/
