"""The core holds no CUDA or process state: CUDA streams, thread pools and arenas live in ``transport/``.

An AST scan of every core module (the package outside ``integration/``, ``transport/`` and ``cli/``): none uses
``torch.cuda``, and none keeps, at module level, a mutable registry of streams, pools, arenas or spares (a
container or an object made at import, whose name, annotation or constructor names one of them).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "vllm_lora_ext"
OUTSIDE_CORE = ("integration", "transport", "cli")
_REGISTRY_WORDS = re.compile(r"stream|pool|arena|spare|executor", re.IGNORECASE)
_CONTAINERS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)


def _core_modules() -> list[Path]:
    return [p for p in sorted(SRC.rglob("*.py")) if p.relative_to(SRC).parts[0] not in OUTSIDE_CORE]


def _cuda_uses(tree: ast.AST) -> list[int]:
    """Lines that touch ``torch.cuda``: the attribute, or an import of it."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Name) \
                and node.value.id == "torch":
            lines.append(node.lineno)
        elif isinstance(node, ast.Import) and any(a.name.startswith("torch.cuda") for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (
                (node.module or "").startswith("torch.cuda")
                or (node.module == "torch" and any(a.name == "cuda" for a in node.names))):
            lines.append(node.lineno)
    return lines


def _registries(tree: ast.Module) -> list[str]:
    """Module-level names bound to a mutable container or a made object, that name a stream, pool, arena or spare."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, annotation, value = node.targets, None, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, annotation, value = [node.target], node.annotation, node.value
        else:
            continue
        if not isinstance(value, (*_CONTAINERS, ast.Call)):
            continue
        made = ast.unparse(value.func) if isinstance(value, ast.Call) else ""
        words = " ".join([*(ast.unparse(t) for t in targets), ast.unparse(annotation) if annotation else "", made])
        if _REGISTRY_WORDS.search(words):
            found.append(f"{words.split()[0]} (line {node.lineno})")
    return found


def test_no_core_module_uses_torch_cuda() -> None:
    uses = {p.relative_to(SRC).as_posix(): lines for p in _core_modules()
            if (lines := _cuda_uses(ast.parse(p.read_text())))}
    assert uses == {}, f"move CUDA work to transport/: {uses}"


def test_no_core_module_keeps_a_registry_of_streams_pools_or_arenas() -> None:
    found = {p.relative_to(SRC).as_posix(): names for p in _core_modules()
             if (names := _registries(ast.parse(p.read_text())))}
    assert found == {}, f"process state belongs in transport/: {found}"


def test_the_scan_finds_what_it_looks_for() -> None:
    """The control: the forms the core used to hold are each found."""
    source = ("import torch\nimport threading\n"
              "_STREAMS: dict[int, list] = {}\n"
              "_IDLE: dict[str, list[ThreadPoolExecutor]] = {}\n"
              "_SPARE = _Spare()\n"
              "_LOCK = threading.Lock()\n"
              "HUGE_PAGE = 2 << 20\n"
              "def f():\n    return torch.cuda.current_device()\n")
    tree = ast.parse(source)
    assert [n.split()[0] for n in _registries(tree)] == ["_STREAMS", "_IDLE", "_SPARE"]
    assert _cuda_uses(tree) == [9]
