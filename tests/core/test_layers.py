"""The package's layers (STYLE.md §1): no import cycle at any level, and no import back up a layer.

The import graph is built from the source, not from ``sys.modules``: every ``import`` and ``from ... import``
counts, at module level, inside functions and under ``if TYPE_CHECKING:``, with relative imports resolved.
``from pkg import name`` is an edge to ``pkg.name`` where that is a module, else to ``pkg``.

A few cycles predate the rule. Their edges are listed below; the list may shrink, never grow.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

PACKAGE = "vllm_lora_ext"
SRC = Path(__file__).resolve().parents[2] / "src" / PACKAGE

# importer -> imported, both relative to the package: every edge that lies on a cycle today (none).
KNOWN_CYCLE_EDGES: set[tuple[str, str]] = set()
# Modules that the CLI starts as a separate process (``python -m``), never imports: `vllm-lora verify` runs vLLM.
CLI_PROCESS_ENTRIES = {f"{PACKAGE}.integration.verify_run"}


def _modules(src: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``)."""
    found = {}
    for path in sorted(src.rglob("*.py")):
        parts = [package, *path.relative_to(src).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom,
             modules: Mapping[str, object]) -> Iterator[str]:
    """The modules one import statement names, relative imports resolved."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    if node.level:
        base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    for alias in node.names:
        yield f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target


def import_graph(src: Path = SRC, package: str = PACKAGE) -> dict[str, dict[str, list[int]]]:
    """importer -> {imported: [line, ...]} over every import statement in the package (external ones included)."""
    modules = _modules(src, package)
    graph: dict[str, dict[str, list[int]]] = {}
    for name, (path, is_package) in modules.items():
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(name, is_package, node, modules):
                    while target not in modules and target.startswith(package + "."):
                        target = target.rsplit(".", 1)[0]  # a name from a module, not a module
                    if target != name:
                        edges.setdefault(target, []).append(node.lineno)
    return graph


def cycles(graph: Mapping[str, Mapping[str, object]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in graph), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def _short(name: str) -> str:
    return name[len(PACKAGE) + 1:] if name.startswith(PACKAGE + ".") else name


def _in(name: str, *layers: str) -> bool:
    return any(name == f"{PACKAGE}.{layer}" or name.startswith(f"{PACKAGE}.{layer}.") for layer in layers)


def _is_vllm(name: str) -> bool:
    return name == "vllm" or name.startswith("vllm.")


def test_the_graph_builder_finds_a_cycle_made_by_function_level_relative_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import f\n")
    (pkg / "a.py").write_text("def g():\n    from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import g\n")
    (pkg / "leaf.py").write_text("from pkg.a import g\nimport os\n")
    graph = import_graph(tmp_path / "pkg", "pkg")
    assert graph["pkg.a"] == {"pkg.sub.b": [2]}
    assert graph["pkg.sub.b"] == {"pkg.a": [2]}
    assert graph["pkg.leaf"] == {"pkg.a": [1], "os": [2]}
    assert cycles(graph) == [{"pkg.a", "pkg.sub.b"}]


def test_no_import_cycle_at_any_level_except_the_listed_ones_which_never_grow() -> None:
    graph = import_graph()
    on_cycles = {(_short(a), _short(b)) for component in cycles(graph) for a in component for b in graph[a]
                 if b in component}
    new = {edge: graph[f"{PACKAGE}.{edge[0]}"][f"{PACKAGE}.{edge[1]}"] for edge in on_cycles - KNOWN_CYCLE_EDGES}
    assert new == {}, f"new import cycle edges (importer, imported): lines {new}"


def test_the_core_never_imports_vllm_integration_or_the_cli() -> None:
    bad = {(_short(a), b, tuple(lines)) for a, edges in import_graph().items() for b, lines in edges.items()
           if not _in(a, "integration", "cli", "transport") and (_is_vllm(b) or _in(b, "integration", "cli"))}
    assert bad == set()


def test_only_integration_imports_vllm_and_nothing_imports_the_cli_from_outside() -> None:
    graph = import_graph()
    vllm = {(_short(a), b) for a, edges in graph.items() for b in edges if not _in(a, "integration") and _is_vllm(b)}
    cli = {(_short(a), _short(b)) for a, edges in graph.items() for b in edges if _in(b, "cli") and not _in(a, "cli")}
    assert (vllm, cli) == (set(), set())


def test_the_cli_reaches_integration_only_through_the_listed_process_entries() -> None:
    graph = import_graph()
    imported = {(_short(a), _short(b)) for a, edges in graph.items() for b in edges
                if _in(a, "cli") and _in(b, "integration")}
    assert imported == set()
    named = {node.value for path in (SRC / "cli").rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and node.value.startswith(f"{PACKAGE}.integration")}
    assert named == CLI_PROCESS_ENTRIES
    assert all(name in _modules(SRC, PACKAGE) for name in CLI_PROCESS_ENTRIES)


def test_the_leaves_import_only_each_other_and_errors_imports_nothing_of_the_package() -> None:
    leaves = {f"{PACKAGE}.{m}" for m in ("errors", "constants", "_util", "_logging")}
    graph = import_graph()
    reach = {_short(a): sorted(_short(b) for b in graph[a] if b.startswith(PACKAGE) and b not in leaves)
             for a in leaves}
    assert reach == {_short(m): [] for m in leaves}
    assert [b for b in graph[f"{PACKAGE}.errors"] if b.startswith(PACKAGE)] == []


# STYLE.md §1: the transport layer (memory, hand-over, pools, CUDA) sits above the data modules (formats, mixing,
# reader, ...): only the planners above it and the integration reach down into it. Calls that still go up from the
# data modules are listed here, with the line that makes them; the list may shrink, never grow.
ABOVE_TRANSPORT = ("integration", "cli", "transport", "building", "planning", "offline_ops", "offline_writes",
                   "prebuild", "verification")
KNOWN_UPWARD = {
    ("reader", "transport.cuda"),  # SafetensorsReader._transposed_on: a fused factor turned on the worker's GPU
}


def test_the_data_modules_never_import_the_transport_layer_above_them() -> None:
    up = {(_short(a), _short(b)) for a, edges in import_graph().items() for b in edges
          if _in(b, "transport") and a.startswith(PACKAGE) and not _in(a, *ABOVE_TRANSPORT)}
    assert up - KNOWN_UPWARD == set()
