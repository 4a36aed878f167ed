"""Every name the bench scripts, GPU scripts and GPU tests import from the package exists.

Those files run only on a lent GPU machine, and many import inside functions, so a rename in ``src/`` breaks
them where no CPU run looks: ``bench_moe_decode.py`` imported ``mix_adapter_files`` from the module it had
left, and an H200 call found out after the engine set-up. This reads each file's imports (every
``from vllm_lora_ext... import`` at any depth) and looks each name up in the package's source.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted([*ROOT.glob("bench/*.py"), *ROOT.glob("scripts/**/*.py"), *ROOT.glob("tests/gpu/*.py")])


def _imports(path: Path) -> list[tuple[str, str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("vllm_lora_ext"):
            found += [(node.module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "", node.lineno) for alias in node.names if alias.name.startswith("vllm_lora_ext")]
    return found


def _defined(module: str) -> set[str] | None:
    """The names ``module`` defines at its top level (in ``if``/``try`` blocks too) and its submodules, read from
    its source, so a module that needs what this machine lacks (Ray) is checked too; None: no such module."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    names: set[str] = set()
    if spec.submodule_search_locations:
        names |= {p.stem for folder in spec.submodule_search_locations for p in Path(folder).iterdir()}
    body = list(ast.parse(Path(spec.origin).read_text(encoding="utf-8")).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try)):
            body += [*node.body, *node.orelse, *getattr(node, "finalbody", []),
                     *(n for h in getattr(node, "handlers", []) for n in h.body)]
    return names


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_package_name_a_script_imports_exists(path: Path) -> None:
    missing = []
    for module, name, line in _imports(path):
        defined = _defined(module)
        if defined is None:
            missing.append(f"line {line}: no module {module}")
        elif name and name != "*" and name not in defined:
            missing.append(f"line {line}: {name} from {module}")
    assert not missing, f"{path.relative_to(ROOT)} imports names the package no longer has: {missing}"


def test_the_scripts_are_found() -> None:
    names = {p.name for p in FILES}
    assert {"bench_moe_decode.py", "moe_matrix.py", "parallel.py", "test_e2e.py"} <= names


def _vllm_imports(path: Path) -> list[tuple[str, str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
            found += [(node.module, alias.name, node.lineno) for alias in node.names]
    return found


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_vllm_name_a_gpu_script_imports_exists_in_the_vllm_the_gpu_runs(path: Path) -> None:
    """The GPU machine runs vLLM 0.26: on that leg, every ``from vllm... import`` name these files use is there."""
    vllm = pytest.importorskip("vllm")
    if not str(vllm.__version__).startswith("0.26."):
        pytest.skip(f"the GPU runs vLLM 0.26; this is {vllm.__version__}")
    missing = []
    for module, name, line in _vllm_imports(path):
        defined = _defined(module)
        if defined is None or (name != "*" and name not in defined):
            missing.append(f"line {line}: {name} from {module}")
    assert not missing, f"{path.relative_to(ROOT)} imports what vLLM 0.26 does not have: {missing}"
