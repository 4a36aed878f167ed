"""Source grammar, parsing and local resolution."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from factories import dense_tensors, lora_config, make_dense_adapter, write_adapter
from vllm_lora_ext import AdapterNotFoundError, AdapterSourceError, UnsafeFormatError, parse_source, resolve_source
from vllm_lora_ext.errors import AdapterFormatError
from vllm_lora_ext.summary import load_config

SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize(
    ("source", "repo", "revision", "path", "names_file"),
    [
        ("hf:acme/sql", "acme/sql", None, None, False),
        ("hf:acme/sql@v1.2", "acme/sql", "v1.2", None, False),
        ("hf:acme/loras:sql", "acme/loras", None, "sql", False),
        ("hf:acme/loras:a/b/w.safetensors", "acme/loras", None, "a/b/w.safetensors", True),
        (f"hf:acme/loras@{SHA}:w.safetensors", "acme/loras", SHA, "w.safetensors", True),
        ("hf:acme/loras@refs/pr/3:sub", "acme/loras", "refs/pr/3", "sub", False),
        ("hf:gpt2", "gpt2", None, None, False),
    ],
)
def test_parse_source_reads_every_hub_form(source: str, repo: str, revision: str | None, path: str | None,
                                           names_file: bool) -> None:
    s = parse_source(source)
    assert (s.kind, s.repo_id, s.revision, s.path_in_repo, s.names_file) == ("hf", repo, revision, path, names_file)
    assert s.canonical() == source


def test_parse_source_marks_sha_revisions_as_pinned() -> None:
    assert parse_source(f"hf:a/b@{SHA}").is_pinned
    assert not parse_source("hf:a/b@main").is_pinned


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        ("hf:", "empty repo id"),
        ("hf:acme/sql@:a.safetensors", "empty revision after '@'"),
        ("hf:acme/sql:", "empty path after ':'"),
        ("hf:acme/sql:/etc/passwd", "absolute path"),
        ("hf:acme/sql:../x.safetensors", "'..' in path"),
        ("hf:acme/sql:a/../../x.safetensors", "'..' in path"),
        ("hf:acme/sql:a\\b.safetensors", "backslash"),
        ("hf:acme/sql:a\x00b", "NUL"),
        ("hf:acme/sql:a//b.safetensors", "empty or '.' component"),
        ("hf:a/b/c", "must be 'org/repo'"),
        ("hf:acme/-bad", "invalid name"),
        ("hf:acme/a--b", "invalid name"),
        ("hf:acme/sql@bad..rev", "not a valid branch"),
        ("hf:acme/sql@a/.", "not a valid branch"),  # the cache would write the ref 'a'
        ("hf:acme/sql@a//b", "not a valid branch"),
        ("hf:acme/sql@.", "not a valid branch"),
        ("hf:acme/sql@/main", "not a valid branch"),
        ("hf:acme/sql:adapter_config.json", "is a config file"),
        ("hf://acme/sql", "unknown scheme"),
        (" hf:acme/sql", "whitespace"),
        ("", "Empty adapter source"),
        ("hf:acme/sql:" + "a/" * 2000 + "x.safetensors", "path of 2001 parts"),  # a bare RecursionError in the cache
    ],
)
def test_parse_source_rejects_malformed_sources_with_the_fix(source: str, fragment: str) -> None:
    with pytest.raises(AdapterSourceError) as e:
        parse_source(source)
    assert fragment in str(e.value)
    assert e.value.source == source


@pytest.mark.parametrize("source", ["hf:acme/sql:model.bin", "hf:acme/sql:a/w.pt", "/tmp/x/adapter_model.bin"])
def test_parse_source_refuses_pickle_without_opt_in(source: str) -> None:
    with pytest.raises(UnsafeFormatError, match="VLLM_LORA_EXT_ALLOW_PICKLE=1"):
        parse_source(source)
    assert parse_source(source, allow_pickle=True).names_file


def test_parse_source_expands_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert parse_source("~/ad").local_path == tmp_path / "ad"


def test_resolve_local_folder_finds_weights_and_config(tmp_path: Path) -> None:
    make_dense_adapter(tmp_path / "a")
    r = resolve_source(str(tmp_path / "a"))
    assert r.weights_path == tmp_path / "a" / "adapter_model.safetensors"
    assert r.config_rule == "adapter_config.json"
    assert r.commit is None


@pytest.mark.parametrize(("config_name", "rule"), [("sql_config.json", "<stem>_config.json"), ("sql.json", "<stem>.json"),
                                                   ("adapter_config.json", "adapter_config.json")])
def test_resolve_local_file_uses_the_config_lookup_rules(tmp_path: Path, config_name: str, rule: str) -> None:
    write_adapter(tmp_path, dense_tensors({"model.layers.0.self_attn.q_proj": (8, 8)}), lora_config(),
                  weights_name="sql.safetensors", config_name=config_name)
    r = resolve_source(str(tmp_path / "sql.safetensors"))
    assert (r.config_path.name if r.config_path else None, r.config_rule) == (config_name, rule)


def test_per_file_config_wins_over_a_shared_adapter_config(tmp_path: Path) -> None:
    write_adapter(tmp_path, dense_tensors({"m.q_proj": (8, 8)}), lora_config(r=4), weights_name="a.safetensors",
                  config_name="a_config.json")
    (tmp_path / "adapter_config.json").write_text('{"r": 99, "lora_alpha": 1}')
    r = resolve_source(str(tmp_path / "a.safetensors"))
    assert r.config_rule == "<stem>_config.json"
    assert load_config(r).r == 4


def test_bare_file_without_config_infers_rank_and_reads_alpha_from_metadata(tmp_path: Path) -> None:
    write_adapter(tmp_path, dense_tensors({"m.q_proj": (8, 8), "m.v_proj": (8, 4)}, rank=6), None,
                  weights_name="x.safetensors", metadata={"lora_alpha": "12"})
    r = resolve_source(str(tmp_path / "x.safetensors"))
    cfg = load_config(r)
    assert (r.config_rule, cfg.r, cfg.lora_alpha, cfg.inferred) == ("inferred", 6, 12.0, True)


def test_bare_file_without_alpha_fails_saying_what_to_add(tmp_path: Path) -> None:
    write_adapter(tmp_path, dense_tensors({"m.q_proj": (8, 8)}), None, weights_name="x.safetensors")
    with pytest.raises(AdapterFormatError, match="lora_alpha.*Add an adapter_config.json"):
        load_config(resolve_source(str(tmp_path / "x.safetensors")))


def test_a_missing_local_file_that_reads_like_a_hub_file_is_told_how_to_write_the_hub(tmp_path: Path,
                                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``acme/loras:style.safetensors`` without ``hf:`` is a local path; the refusal says how to name the Hub."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AdapterNotFoundError, match="write hub sources as 'hf:org/repo:file'"):
        resolve_source("acme/loras:style.safetensors")


def test_missing_local_folder_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(AdapterNotFoundError, match="does not exist"):
        resolve_source(str(tmp_path / "nope"))


def test_folder_without_standard_weights_names_the_files_it_has(tmp_path: Path) -> None:
    write_adapter(tmp_path, dense_tensors({"m.q_proj": (8, 8)}), lora_config(), weights_name="other.safetensors")
    with pytest.raises(AdapterNotFoundError, match="other.safetensors"):
        resolve_source(str(tmp_path))


def test_folder_with_only_pickle_weights_is_refused_without_opt_in(tmp_path: Path) -> None:
    tmp_path.joinpath("adapter_config.json").write_text('{"r": 2, "lora_alpha": 2}')
    torch.save({"m.lora_A.weight": torch.zeros(2, 2)}, tmp_path / "adapter_model.bin")
    with pytest.raises(UnsafeFormatError):
        resolve_source(str(tmp_path))
    assert resolve_source(str(tmp_path), allow_pickle=True).is_pickle


@pytest.mark.parametrize(("extra", "fragment"), [({"use_dora": True}, "DoRA"), ({"bias": "all"}, "bias"),
                                                 ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
                                                 ({"peft_type": "IA3"}, "not LoRA"),
                                                 ({"init_lora_weights": "pissa"}, "pissa")])
def test_unsupported_adapter_features_are_refused_by_name(tmp_path: Path, extra: dict, fragment: str) -> None:
    make_dense_adapter(tmp_path, **extra)
    with pytest.raises(AdapterFormatError, match=fragment):
        load_config(resolve_source(str(tmp_path)))
