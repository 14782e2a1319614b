"""The completer package's import graph, read from its source with `ast`:
every `import` and `from ... import` in completer/, those under `if
TYPE_CHECKING:` and inside functions included (a cycle through a type-only
import is still two modules that cannot be understood, or moved, apart).

The server has none: its front doors (server/session.py, server/compat/)
reach the pipeline and the engine through server/service.py, and only
server/app.py, which builds them, knows them all; nothing in the server
imports app.py (the CLI does).

The config's schemas sit below every subsystem: completer/config/ reaches
none of completer's subpackages (engine, server, disagg, cluster, lsp, ...),
which import their sections from it."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "completer"


def module_names() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package."""
    out = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports, anywhere in its source. A
    `from pkg import x` names the module pkg.x where there is one, else pkg."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's), each sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_reader_sees_type_checking_and_function_imports():
    graph = import_graph()
    assert "completer.server.app" in graph["completer.cli"]  # imported inside a function
    assert "completer.engine.request" in graph["completer.pipeline"]


def test_the_server_has_no_import_cycle():
    found = [c for c in cycles(import_graph()) if any(m.startswith("completer.server") for m in c)]
    assert not found, f"import cycles through the server: {found}"


def test_only_the_cli_imports_the_app():
    graph = import_graph()
    importers = sorted(name for name, imported in graph.items() if "completer.server.app" in imported)
    assert importers == ["completer.cli"], importers


def test_the_front_doors_reach_the_engine_through_the_service():
    """server/session.py and server/compat/ import neither the app nor the engine's module."""
    graph = import_graph()
    doors = [n for n in graph if n == "completer.server.session" or n.startswith("completer.server.compat")]
    leaks = {n: sorted(graph[n] & {"completer.server.app", "completer.engine.engine", "completer.pipeline"})
             for n in doors}
    assert not {n: m for n, m in leaks.items() if m}, leaks


def test_no_import_cycle_in_the_package():
    assert not (found := cycles(import_graph())), f"import cycles: {found}"


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for imported in graph[todo.pop()] - seen:
            seen.add(imported)
            todo.append(imported)
    return seen


def imports_torch(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(n == "torch" or n.startswith("torch.") for n in names):
            return True
    return False


# docs/architecture.md's claims on the direction of dependencies, checked.

def test_the_wire_schema_and_the_client_know_nothing_of_torch():
    graph, modules = import_graph(), module_names()
    for start in ("completer.protocol", "completer.client", "completer.engine.request"):
        with_torch = sorted(m for m in reachable(graph, start) if imports_torch(modules[m]))
        assert not with_torch, f"{start} reaches torch through {with_torch}"


def test_the_engine_knows_models_and_tokenizers_never_the_protocol_or_the_server():
    graph = import_graph()
    outward = ("completer.protocol", "completer.server", "completer.pipeline", "completer.cluster",
               "completer.document", "completer.prompt")
    found = {n: sorted(m for m in imported if m.startswith(outward))
             for n, imported in graph.items() if n.startswith("completer.engine")}
    assert not {n: m for n, m in found.items() if m}, found


def test_the_server_knows_the_engine_only_by_its_async_face():
    graph = import_graph()
    face = {"completer.engine.engine", "completer.engine.request", "completer.engine.streams"}
    found = {n: sorted(m for m in imported if m.startswith("completer.engine") and m not in face)
             for n, imported in graph.items() if n.startswith("completer.server")}
    assert not {n: m for n, m in found.items() if m}, found


def test_the_engine_imports_nothing_of_the_subsystems_that_plug_into_it():
    """Disaggregation plugs into the engine through engine/kv_connector.py's
    protocol (as vLLM's KV connector); the engine names no module of
    disagg/, cluster/, lsp/ or the server, not even for types."""
    graph = import_graph()
    plugged = ("completer.disagg", "completer.cluster", "completer.lsp", "completer.server")
    found = {n: sorted(m for m in imported if m.startswith(plugged))
             for n, imported in graph.items() if n.startswith("completer.engine")}
    assert not {n: m for n, m in found.items() if m}, found


def subsystems() -> set[str]:
    """completer's subpackages but the config: every folder with an __init__.py (a new one is one too)."""
    return {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / PACKAGE).rglob("__init__.py")
            if p.parent != ROOT / PACKAGE} - {"completer.config"}


def config_reaches_subsystems(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """For each module of completer.config, the subsystem modules it reaches (through any chain of imports)."""
    inside = subsystems()
    found = {}
    for name in graph:
        if name == "completer.config" or name.startswith("completer.config."):
            reached = sorted(m for m in reachable(graph, name)
                             if any(m == s or m.startswith(s + ".") for s in inside))
            if reached:
                found[name] = reached
    return found


def test_the_config_imports_no_subsystem():
    graph = import_graph()
    assert {"completer.config.engine", "completer.config.load"} <= set(graph)
    assert {"completer.engine", "completer.server", "completer.cluster", "completer.disagg"} <= subsystems()
    assert not (found := config_reaches_subsystems(graph)), f"completer.config reaches subsystems: {found}"


def test_the_config_direction_check_sees_an_import_of_a_subsystem():
    """A section's module importing the engine's, directly or through a top-level module, is caught."""
    graph = import_graph()
    direct = {**graph, "completer.config.engine": graph["completer.config.engine"] | {"completer.engine.request"}}
    assert "completer.engine.request" in config_reaches_subsystems(direct).get("completer.config.engine", [])
    through = {**graph, "completer.config.model": graph["completer.config.model"] | {"completer.pipeline"}}
    assert "completer.engine.request" in config_reaches_subsystems(through)["completer.config.model"]


def test_the_config_knows_nothing_of_torch():
    """Reading a config (`completer lsp`, `--help`, a client) loads no model code."""
    graph, modules = import_graph(), module_names()
    with_torch = sorted(m for m in reachable(graph, "completer.config") if imports_torch(modules[m]))
    assert not with_torch, f"completer.config reaches torch through {with_torch}"
