"""One rule, one place: the environment is read in `constants.py` only, and each limit is written there once."""

from __future__ import annotations

import ast
from pathlib import Path

from vllm_lora_ext import constants, reader

SRC = Path(__file__).resolve().parents[2] / "src" / "vllm_lora_ext"
# path -> why it may touch os.environ: it hands the whole environment on, reading no setting from it.
ENVIRONMENT_USERS = {"integration/build_process.py": "the build process starts with this process's environment"}


def _sources() -> dict[str, ast.AST]:
    return {p.relative_to(SRC).as_posix(): ast.parse(p.read_text()) for p in sorted(SRC.rglob("*.py"))}


def _touches_environment(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "unsetenv"):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and \
                any(a.name in ("environ", "getenv") for a in node.names):
            lines.append(node.lineno)
    return lines


def test_only_constants_reads_or_writes_the_environment() -> None:
    found = {path: lines for path, tree in _sources().items() if (lines := _touches_environment(tree))}
    assert set(found) - {"constants.py"} == set(ENVIRONMENT_USERS)


def test_each_limit_is_spelled_once_in_constants() -> None:
    spelled = {"512 << 20": [], "16 << 20": []}
    compared = []
    for path, tree in _sources().items():
        if path == "constants.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and ast.unparse(node) in spelled:
                spelled[ast.unparse(node)].append(f"{path}:{node.lineno}")
            bound = node if isinstance(node, ast.Compare) else node.upper if isinstance(node, ast.Slice) else None
            if bound is not None and any(isinstance(c, ast.Constant) and c.value in (4096, 2000)
                                         for c in ast.walk(bound)):
                compared.append(f"{path}:{node.lineno}")
    assert (spelled, compared) == ({"512 << 20": [], "16 << 20": []}, [])
    assert constants.MAX_MODEL_FIELD_CHARS == 4096
    assert reader._GPU_HEADROOM == constants.GPU_HEADROOM_BYTES == 512 << 20


def test_the_metrics_folder_is_exported_and_taken_back_through_constants(monkeypatch) -> None:
    monkeypatch.delenv(constants.ENV_METRICS_DIR, raising=False)
    monkeypatch.delenv(constants.PROMETHEUS_DIR_ENV, raising=False)
    constants.export_metrics_dir("/a")
    assert constants.metrics_dir_setting() == "/a" and not constants.prometheus_dir_set()
    constants.export_metrics_dir(None, only_if="/b")  # names another folder: kept
    assert constants.metrics_dir_setting() == "/a"
    constants.export_metrics_dir(None, only_if="/a")
    assert constants.metrics_dir_setting() is None
    monkeypatch.setenv(constants.PROMETHEUS_DIR_ENV, "/p")
    constants.export_metrics_dir("/a")
    assert constants.metrics_dir_setting() == "/p" and constants.prometheus_dir_set()
    constants.export_metrics_dir(None)


def test_the_component_cache_size_reads_whole_numbers_and_falls_back_to_8(monkeypatch) -> None:
    for raw, expected in (("3", 3), ("0", 0), ("-2", 0), ("x", 8), ("2.5", 8)):
        monkeypatch.setenv(constants.ENV_COMPONENT_CACHE, raw)
        assert constants.component_cache_size() == expected
    monkeypatch.delenv(constants.ENV_COMPONENT_CACHE)
    assert constants.component_cache_size() == 8
