"""plan_model_id: what a Ray Serve LLM id ``<base>:<adapter>`` asks the plugin for (pure, no Ray)."""

from __future__ import annotations

import pytest

from vllm_lora_ext import AdapterAccessError, AdapterNotFoundError, AdapterSourceError
from vllm_lora_ext.constants import MAX_MODEL_FIELD_CHARS
from vllm_lora_ext.multiplex import Plan, plan_model_id, split_model_id

NAMES = {"style", "domain", "mix-style=0.5+domain=0.5-40000001"}


@pytest.mark.parametrize("model_id, plan, adapter", [
    ("qwen:style", Plan.NAME, "style"),
    ("qwen:mix-style=0.5+domain=0.5-40000001", Plan.NAME, "mix-style=0.5+domain=0.5-40000001"),
    ("qwen:style=0.7+domain=0.3", Plan.MIX, "style=0.7+domain=0.3"),
    ("qwen:style+domain", Plan.MIX, "style+domain"),
    ("qwen:style=2", Plan.MIX, "style=2"),  # one adapter at weight 2 is a mix too
])
def test_names_and_mixes_go_to_the_plugin(model_id: str, plan: Plan, adapter: str) -> None:
    got = plan_model_id(model_id, names=NAMES)
    assert (got.plan, got.adapter, got.model_id) == (plan, adapter, model_id)


def test_a_source_goes_to_the_plugin_only_under_an_admitted_prefix() -> None:
    mid = "qwen:hf:acme/loras@v1:sql/adapter.safetensors"
    assert split_model_id(mid) == ("qwen", "hf:acme/loras@v1:sql/adapter.safetensors")
    got = plan_model_id(mid, names=NAMES, client_sources=("hf:acme/",))
    assert (got.plan, got.adapter) == (Plan.SOURCE, "hf:acme/loras@v1:sql/adapter.safetensors")
    for prefixes in ((), ("hf:other/",), ("",)):
        with pytest.raises(AdapterAccessError, match="VLLM_LORA_EXT_CLIENT_SOURCES"):
            plan_model_id(mid, names=NAMES, client_sources=prefixes)


@pytest.mark.parametrize("adapter", ["/etc", "../x", "~/loras/a", "file:///etc", "hf:acme/x", "a\\b"])
def test_paths_and_sources_are_refused_by_default_even_with_a_ray_downloader(adapter: str) -> None:
    with pytest.raises(AdapterAccessError):
        plan_model_id(f"qwen:{adapter}", names=NAMES, ray_downloads=True)


def test_an_unknown_name_goes_to_rays_downloader_when_there_is_one_else_404_naming_what_is_served() -> None:
    assert plan_model_id("qwen:folder-7", names=NAMES, ray_downloads=True).plan is Plan.RAY
    with pytest.raises(AdapterNotFoundError, match="'domain', 'mix-.*', 'style'"):
        plan_model_id("qwen:folder-7", names=NAMES)


@pytest.mark.parametrize("model_id, match", [
    ("qwen:", "no adapter"),
    ("qwen:" + "a" * (MAX_MODEL_FIELD_CHARS + 1), "characters"),
    ('qwen:mix:{"v":1}', "only the server makes"),
    ("qwen:vllm-lora-ext-prebuild:/x", "only the server makes"),
])
def test_malformed_ids_are_refused(model_id: str, match: str) -> None:
    with pytest.raises(AdapterSourceError, match=match):
        plan_model_id(model_id, names=NAMES, ray_downloads=True)


def test_the_not_found_message_lists_at_most_twenty_names() -> None:
    many = {f"n{i:03d}" for i in range(500)}
    with pytest.raises(AdapterNotFoundError) as info:
        plan_model_id("qwen:zzz", names=many)
    assert "n019" in str(info.value) and "n020" not in str(info.value)
