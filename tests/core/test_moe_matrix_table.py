"""README's table of MoE architectures is what the GPU matrix found (bench/results/moe_matrix_h200.json)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from factories import load_bench

ROOT = Path(__file__).resolve().parents[2]


def _matrix() -> object:
    return load_bench("moe_matrix")


def test_the_readme_architecture_table_equals_what_the_matrix_found() -> None:
    doc = json.loads((ROOT / "bench" / "results" / "moe_matrix_h200.json").read_text())
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- generated: moe-matrix[^\n]*-->\n(.*?)\n<!-- end: moe-matrix -->", readme, re.S)
    assert found is not None, "README has no generated moe-matrix table"
    assert found.group(1) == _matrix().render_table(doc), (
        "README's architecture table differs from bench/results/moe_matrix_h200.json: regenerate it with "
        "python bench/moe_matrix.py --render bench/results/moe_matrix_h200.json")


def test_no_architecture_is_served_wrong_in_the_recorded_matrix() -> None:
    doc = json.loads((ROOT / "bench" / "results" / "moe_matrix_h200.json").read_text())
    wrong = [(r["arch"], g) for r in doc["results"] if r["status"] == "ran"
             for g, c in r["groups"].items() if c["verdict"] == "WRONG"]
    assert wrong == []
    refused = {(r["arch"], g) for r in doc["results"] if r["status"] == "ran"
               for g, c in r["groups"].items() if c["verdict"] == "refused"}
    assert ("DeepseekV2ForCausalLM", "attn.kv_b_proj") in refused  # MLA folds it: refused, never served wrong
    assert ("Qwen2MoeForCausalLM", "shared expert gate") in refused
