"""Layering rules, read from the source with `ast` (nothing is imported, so this stays fast and
checks modules whose dependencies are missing here too).

- services/common is the bottom layer: it imports nothing else from the project.
- The project's modules import each other without cycles. The graph holds every import that runs
  when a module is imported, `if TYPE_CHECKING:` blocks included (a cycle there is still a design
  knot, and breaks as soon as someone needs the name at runtime); imports inside functions are
  left out: they run later, on purpose.
- services/stack starts the services by their command lines and never imports kvrelay.cli, even
  inside a function: the cli imports the stack (for `up`), not the other way round.
- The scheduler's bookkeeping modules know nothing of the wire format (no `_pb2` module): the
  protobuf conversions live at the edge, in the service. The same holds for the worker's core.
- Nor do the gateway's core and its REST app (no `_pb2`, no google.protobuf): its service edge
  converts.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# folder -> the package it installs as (setup.py)
PACKAGES = {"services": ["kvrelay"], "kernels": ["kvrelay", "kernels"]}


def _module_name(path: Path) -> str:
    folder, *parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(PACKAGES[folder] + parts)


def _project_sources() -> dict[str, Path]:
    return {_module_name(path): path
            for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


SOURCES = _project_sources()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in SOURCES.items()}


def _is_package(module: str) -> bool:
    return SOURCES[module].name == "__init__.py"


def _import_nodes(node: ast.AST, module_level_only: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements under `node`; with `module_level_only`, not descending into
    function bodies (class bodies run at import time, so they count)."""
    for child in ast.iter_child_nodes(node):
        if module_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                    ast.Lambda)):
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _import_nodes(child, module_level_only)


def _names(module: str, node: ast.Import | ast.ImportFrom) -> Iterator[tuple[str, str | None]]:
    """(module imported from, name taken from it or None) for each alias, as absolute names."""
    if isinstance(node, ast.Import):
        yield from ((alias.name, None) for alias in node.names)
        return
    base = node.module or ""
    if node.level:  # relative: resolve against this module's package
        package = module.split(".")
        if not _is_package(module):
            package.pop()
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    yield from ((base, alias.name) for alias in node.names)


def _project_imports(module: str, module_level_only: bool) -> set[str]:
    """The project modules `module` imports: for `from a.b import c`, a.b.c when that is a
    module, else a.b. The packages above a target (a and a.b for `import a.b.c`) run too, but
    are not edges: a package's __init__ importing its own submodules is no cycle worth a test."""
    found = set()
    for node in _import_nodes(TREES[module], module_level_only):
        for base, name in _names(module, node):
            target = f"{base}.{name}" if name and f"{base}.{name}" in SOURCES else base
            if target in SOURCES and target != module:
                found.add(target)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One concrete loop through the component's first module, for a readable failure."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for target in sorted(graph[node] & members):
            if target == start:
                return paths[node] + [start]
            if target not in paths:
                paths[target] = paths[node] + [target]
                frontier.append(target)
    return component


def test_common_imports_only_common():
    allowed = "kvrelay.common"
    bad = {}
    for module in SOURCES:
        if module != allowed and not module.startswith(allowed + "."):
            continue
        outside = sorted(name for name in _project_imports(module, module_level_only=False)
                         if name != allowed and not name.startswith(allowed + "."))
        if outside:
            bad[module] = outside
    assert not bad, f"services/common must import only kvrelay.common.*: {bad}"


def test_no_import_cycles():
    graph = {module: _project_imports(module, module_level_only=True) for module in SOURCES}
    loops = [" -> ".join(_cycle_path(graph, component)) for component in _cycles(graph)]
    assert not loops, "import cycles among the project's modules:\n" + "\n".join(loops)


def test_stack_does_not_import_cli():
    bad = sorted(module for module in SOURCES if module.startswith("kvrelay.stack")
                 and "kvrelay.cli" in _project_imports(module, module_level_only=False))
    assert not bad, f"these import kvrelay.cli, which imports the stack: {bad}"


# Everything of the scheduler but its service edge (edge.py, outputs.py, service.py,
# worker_link.py, main.py and the metrics), which converts protobuf to the core's types.
SCHEDULER_CORE = [f"kvrelay.scheduler.{name}"
                  for name in ("cluster", "registry", "transfers", "step_plan", "records",
                               "messages", "config", "deltas", "core_share", "step_gate",
                               "lease_reaper")]


def _wire_imports(module: str, google_protobuf_too: bool) -> list[str]:
    """The protobuf modules `module` imports anywhere (functions included)."""
    return sorted({f"{base}.{name}" if name else base
                   for node in _import_nodes(TREES[module], module_level_only=False)
                   for base, name in _names(module, node)
                   if (google_protobuf_too and base.startswith("google.protobuf"))
                   or any(part.endswith(("_pb2", "_pb2_grpc"))
                          for part in f"{base}.{name or ''}".split("."))})


def test_the_scheduler_core_modules_exist():
    assert [name for name in SCHEDULER_CORE if name not in SOURCES] == []


@pytest.mark.parametrize("module", SCHEDULER_CORE)
def test_scheduler_core_has_no_protobuf(module):
    wire = _wire_imports(module, google_protobuf_too=False)
    assert not wire, f"{module} imports protobuf modules {wire}"


# Everything of the gateway but its protobuf edge: grpc_api.py and proto_text_fields.py (the
# public Generation service), edge.py, scheduler_group.py and upstream.py (the scheduler's and
# tokenizer's calls and streams) and main.py. The REST app is here: it sees no protobuf either.
GATEWAY_CORE = [f"kvrelay.gateway.{name}"
                for name in ("core", "router", "request_state", "request_group",
                             "detokenize_pipeline", "messages", "errors", "limits", "metrics",
                             "redaction", "stop_strings", "text_fields", "public_tls", "app",
                             "rest_server", "openai_chat", "openai_completions", "openai_limits",
                             "openai_logprobs", "openai_params", "openai_protocol",
                             "openai_serving", "openai_structured", "openai_tools")]

# Everything of the worker but its service edge (edge.py, step_service.py, main.py,
# registration.py, and the gRPC KV transport's wire code in kv_connector/grpc_transport.py),
# plus the step protocol's dataclasses it shares with the scheduler.
WORKER_CORE = ["kvrelay.step_messages"] + [
    f"kvrelay.worker.{name}"
    for name in ("step_executor", "sequences", "step_threads", "warmup", "model_setup",
                 "compute_domain", "openmp_spin", "kv_connector.base", "kv_connector.feed",
                 "kv_connector.sender", "kv_connector.receiver", "kv_connector.shm_transport")]


def test_the_gateway_and_worker_core_modules_exist():
    assert [name for name in GATEWAY_CORE + WORKER_CORE if name not in SOURCES] == []


@pytest.mark.parametrize("module", GATEWAY_CORE)
def test_gateway_core_has_no_protobuf(module):
    wire = _wire_imports(module, google_protobuf_too=True)
    assert not wire, f"{module} imports protobuf modules {wire}"


@pytest.mark.parametrize("module", WORKER_CORE)
def test_worker_core_has_no_protobuf(module):
    wire = _wire_imports(module, google_protobuf_too=False)
    assert not wire, f"{module} imports protobuf modules {wire}"
