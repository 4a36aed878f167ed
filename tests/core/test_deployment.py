"""Deployment config files: named adapters, weights, default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_lora_ext.deployment import DeploymentConfigError, read_deployment_config


def test_yaml_and_json_configs_read_the_same(tmp_path: Path) -> None:
    body = {"adapters": {"sql": {"source": "hf:acme/loras@v2:sql.safetensors", "weight": 0.7},
                         "chat": "hf:acme/chat"}, "default": "sql"}
    (tmp_path / "d.json").write_text(json.dumps(body))
    (tmp_path / "d.yaml").write_text(
        "adapters:\n  sql:\n    source: 'hf:acme/loras@v2:sql.safetensors'\n    weight: 0.7\n  chat: 'hf:acme/chat'\ndefault: sql\n")
    a, b = read_deployment_config(tmp_path / "d.json"), read_deployment_config(tmp_path / "d.yaml")
    assert a.adapters == b.adapters and a.default == b.default == "sql"
    assert a.get("sql").source.revision == "v2" and a.get("chat").weight == 1.0


@pytest.mark.parametrize(("body", "fragment"), [
    ({"adapters": {"a": "hf:x/y"}, "default": "b"}, "default adapter 'b' is not among"),
    ({"adapters": {"a": {"source": "hf:x/y", "weight": float("nan")}}}, "finite"),
    ({"adapters": {"a+b": "hf:x/y"}}, "which the mix grammar reserves"),
    ({"adapters": {"a": {"weight": 1}}}, "needs a 'source'"),
    ({"adapters": {"a": "hf:x/y:../z.safetensors"}}, "'..' in path"),
    ({"adapters": {}, "defaults": "a"}, "unknown keys"),
])
def test_bad_configs_fail_naming_the_problem(tmp_path: Path, body: dict, fragment: str) -> None:
    p = tmp_path / "d.json"
    p.write_text(json.dumps(body))
    with pytest.raises(DeploymentConfigError, match=fragment.replace("+", r"\+").replace("(", r"\(")):
        read_deployment_config(p)


def test_unknown_adapter_lists_known_names(tmp_path: Path) -> None:
    p = tmp_path / "d.json"
    p.write_text(json.dumps({"adapters": {"a": "hf:x/y", "b": "hf:x/z"}}))
    with pytest.raises(DeploymentConfigError, match=r"\['a', 'b'\]"):
        read_deployment_config(p).get("c")


def test_an_explicitly_relative_source_is_read_from_the_config_files_folder(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "conf").mkdir()
    (tmp_path / "elsewhere").mkdir()
    path = tmp_path / "conf" / "d.yaml"
    path.write_text("adapters:\n  a: ./loras/a\n  b: ../shared/b\n")
    monkeypatch.chdir(tmp_path / "elsewhere")
    dep = read_deployment_config(path)
    assert dep.adapters["a"].source.local_path == tmp_path / "conf" / "loras" / "a"
    assert dep.adapters["b"].source.local_path == tmp_path / "shared" / "b"
