"""`vllm-lora mix`: what is allowed but likely a mistake is said on stderr; a bad weight or an unknown name in the
model syntax is refused before torch is imported (r35, a newcomer's review)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from factories import make_dense_adapter


def _mix(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2] / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "vllm_lora_ext.cli", "mix", *argv], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=120)


def test_a_zero_weight_a_repeated_adapter_and_different_base_models_are_noted(tmp_path: Path) -> None:
    a = make_dense_adapter(tmp_path / "a")
    b = make_dense_adapter(tmp_path / "b", seed=1)
    for folder, base in ((a, "org/base-one"), (b, "org/base-two")):
        cfg = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": base}))
    out = _mix(f"{a}=0", f"{a}=0.5", f"{b}=0.5", "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"note: {a} has weight 0" in out.stderr
    assert f"note: {a} is given twice: its rank counts twice" in out.stderr
    assert "trained on different base models" in out.stderr and "org/base-two" in out.stderr
    quiet = _mix("-q", f"{a}=0", f"{a}=0.5", f"{b}=0.5", "-o", str(tmp_path / "quiet"), cwd=tmp_path)
    assert quiet.returncode == 0 and "note:" not in quiet.stderr, quiet.stderr  # -q: errors only
    assert "wrote " in quiet.stdout  # (results still print)


def test_a_bad_weight_and_an_unknown_name_in_the_model_syntax_are_named(tmp_path: Path) -> None:
    a = make_dense_adapter(tmp_path / "a")
    config = tmp_path / "deploy.json"
    config.write_text(json.dumps({"adapters": {"style": str(a)}}))
    out = _mix(f"{a}=abc", "-o", str(tmp_path / "o1"), cwd=tmp_path)
    assert out.returncode == 1 and "Weight 'abc'" in out.stderr and "is not a number" in out.stderr
    out = _mix("style+nosuch", "--config", str(config), "-o", str(tmp_path / "o2"), cwd=tmp_path)
    assert out.returncode == 1 and "names ['nosuch'], which" in out.stderr, out.stderr
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_a_weight_written_with_a_plus_stays_one_weight(tmp_path: Path) -> None:
    """'style=1e+0' is one weight, not the mix 'style=1e' + '0' (a reviewer's find: the unknown-name check split it)."""
    a = make_dense_adapter(tmp_path / "a")
    b = make_dense_adapter(tmp_path / "b", seed=1)
    config = tmp_path / "deploy.json"
    config.write_text(json.dumps({"adapters": {"style": str(a), "domain": str(b)}}))
    out = _mix("style=1e+0", "domain=0.5", "--config", str(config), "-o", str(tmp_path / "o"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
