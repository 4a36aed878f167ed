"""Hostile names and weights for the core rules (issue 35): the reserved mix grammar, canonical weights, quoted numbers.

The server routes run the same rules through vLLM's real API objects in
``tests/integration/test_hostile_names.py``; here each rule is checked where it lives, and every refusal names
what is wrong and the fix.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from vllm_lora_ext.deployment import read_deployment_config
from vllm_lora_ext.errors import AdapterNotFoundError, AdapterSourceError, DeploymentConfigError, MixError
from vllm_lora_ext.mixing import MixComponent, MixSpec, check_weight, parse_mix_expression, parse_weight, resolve_mix
from vllm_lora_ext.multiplex import Plan, plan_model_id
from vllm_lora_ext.naming import check_adapter_name, check_mix_fields, mix_in_model

SOURCES = {"style": "/m/style", "domain": "/m/domain"}
DIGEST = "0123456789abcdef01234567"

# ------------------------------------------------------------------------------------------------ the name rule (22)

RESERVED: list[tuple[str, list[str]]] = [
    ("style=0.7+domain=0.3", ["contains '+' and '='", "e.g. 'style-0.7_domain-0.3'"]),
    ("style+domain", ["contains '+'", "e.g. 'style_domain'"]),
    ("a=b", ["contains '='", "e.g. 'a-b'"]),
    ("+", ["contains '+'", "e.g. '_'"]),
    ("=", ["contains '='"]),
    ("acme/llama+sft", ["contains '+'", "e.g. 'acme/llama_sft'"]),
    ("llama-ckpt=step5000", ["contains '='", "e.g. 'llama-ckpt-step5000'"]),
    ("a\n+b", ["contains '+'"]),
    ("x" * 300 + "+y", ["contains '+'", "..."]),
    ("mix-a", ["starts with 'mix-'", "reserved for the server's weighted mixes", "e.g. 'a'"]),
    ("mix-", ["starts with 'mix-'", "or the prefix 'mix-'."]),
    ("mix-mix-a", ["starts with 'mix-'", "e.g. 'a'"]),
    ("mix-a=0.5-" + DIGEST, ["starts with 'mix-' and contains '='", "e.g. 'a-0.5-" + DIGEST + "'"]),
    ("mix-a=0.5+b=0.5-" + DIGEST, ["starts with 'mix-' and contains '+' and '='"]),
]


@pytest.mark.parametrize(("name", "fragments"), RESERVED, ids=[f"reserved{i}" for i in range(len(RESERVED))])
def test_names_the_mix_grammar_reserves_are_refused_naming_the_part_and_a_name_to_use(name: str,
                                                                                    fragments: list[str]) -> None:
    with pytest.raises(AdapterSourceError) as info:
        check_adapter_name(name)
    message = str(info.value)
    assert info.value.part == "name" and "Choose a name" in message and len(message) < 600, message
    assert message.startswith("Adapter name '" + name[:20].replace("\n", "\\n")), message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("name", ["style", "acme/style-v2", "mix", "mixer", "mix_a", "MIX-a", "a.b", "a-mix-b",
                                  "style＋domain"])  # a fullwidth plus is not the grammar's '+'
def test_names_outside_the_grammar_are_accepted(name: str) -> None:
    check_adapter_name(name)
    assert parse_mix_expression(name) == [(name, None)]  # never read as more than itself


# ------------------------------------------------------------------------------------------------ deployment (12)

DEPLOY_NAMES: list[tuple[str, str]] = [
    ("'style=0.7+domain=0.3'", "Adapter name 'style=0.7+domain=0.3' contains '+' and '='"),
    ("'a+b'", "Adapter name 'a+b' contains '+', which the mix grammar reserves"),
    ("'ckpt=5'", "Adapter name 'ckpt=5' contains '='"),
    ("mix-style", "Adapter name 'mix-style' starts with 'mix-'"),
    ("\"style\\n\"", "Invalid adapter name 'style\\n'"),  # a trailing newline no longer slips past the pattern
    ("'-x'", "Invalid adapter name '-x'"),
]


@pytest.mark.parametrize(("key", "fragment"), DEPLOY_NAMES, ids=[f"dname{i}" for i in range(len(DEPLOY_NAMES))])
def test_a_deployment_config_cannot_name_an_adapter_as_a_mix(tmp_path: Path, key: str, fragment: str) -> None:
    p = tmp_path / "d.yaml"
    p.write_text(f"adapters:\n  {key}: /x\n")
    before = sorted(tmp_path.iterdir())
    with pytest.raises(DeploymentConfigError) as info:
        read_deployment_config(p)
    assert fragment in str(info.value) and str(p) in str(info.value), str(info.value)
    assert sorted(tmp_path.iterdir()) == before and p.read_text() == f"adapters:\n  {key}: /x\n"


DEPLOY_WEIGHTS: list[tuple[str, str]] = [
    ("500", "Weight 500 of adapter 'a' is outside [-100, 100]"),
    ("-500", "Weight -500 of adapter 'a'"),
    ("1000000000000000000000000000000", "Weight 1000000000000000000000000000000 of adapter 'a'"),
    ("101", "Weight 101 of adapter 'a'"),
    ("250.5", "Weight 250.5 of adapter 'a'"),
    ("1" + "0" * 500, "Weight ~10^500 of adapter 'a'"),
]


@pytest.mark.parametrize(("weight", "fragment"), DEPLOY_WEIGHTS,
                         ids=[f"dweight{i}" for i in range(len(DEPLOY_WEIGHTS))])
def test_a_deployment_weight_out_of_range_is_quoted_as_written(tmp_path: Path, weight: str, fragment: str) -> None:
    p = tmp_path / "d.yaml"
    p.write_text(f"adapters:\n  a: {{source: /x, weight: {weight}}}\n")
    with pytest.raises(DeploymentConfigError) as info:
        read_deployment_config(p)
    message = str(info.value)
    assert str(p) in message  # names the file, as every deployment error does
    rest = message.replace(str(p), "")  # tmp_path itself may hold '200' (pytest-of-root/pytest-200/...)
    assert fragment in rest and "200" not in rest, message


# ------------------------------------------------------------------------------------------------ canonical weights (8)

@pytest.mark.parametrize("written", ["-0", "-0.0", "0", "0.000", "0e0", "-0e-3", "-.0", " -0 "])
def test_every_spelling_of_zero_is_one_weight_and_one_mix(written: str) -> None:
    w = parse_weight(written, name="domain")
    assert w == 0.0 and math.copysign(1.0, w) == 1.0
    ref = resolve_mix(["style", "domain"], [0.5, 0.0], sources=SOURCES, default_weights={})
    spec = resolve_mix(*zip(*parse_mix_expression(f"style=0.5+domain={written}")), sources=SOURCES,
                       default_weights={})
    assert spec is not None and ref is not None
    assert (spec.key, spec.lora_name, spec.lora_path) == (ref.key, ref.lora_name, ref.lora_path)
    assert "domain=0-" in spec.lora_name and "-0" not in spec.lora_name.split("domain=")[1][:2]


def test_minus_zero_is_canonical_wherever_a_weight_enters() -> None:
    assert math.copysign(1.0, check_weight(-0.0)) == 1.0
    assert math.copysign(1.0, MixComponent("a", "/a", -0.0).weight) == 1.0
    assert check_mix_fields(["a"], [-0.0]) == (["a"], [0.0])
    assert MixSpec((MixComponent("a", "/a", -0.0),)).key == MixSpec((MixComponent("a", "/a", 0),)).key


# ------------------------------------------------------------------------------------------------ quoted numbers (12)

QUOTED: list[tuple[Any, str, type[Exception]]] = [
    (10**30, "Weight 1000000000000000000000000000000 of adapter 'a' is outside [-100, 100]", MixError),
    (-(10**30), "Weight -1000000000000000000000000000000 of adapter 'a'", MixError),
    (10**400, "Weight ~10^400 of adapter 'a'", MixError),
    (-(10**5000), "Weight -~10^5000 of adapter 'a'", MixError),  # more digits than int -> str allows
    (2**70, "Weight 1180591620717411303424 of adapter 'a'", MixError),
    (500, "Weight 500 of adapter 'a'", MixError),
    (1e30, "Weight 1e+30 of adapter 'a'", MixError),
    (-100.5, "Weight -100.5 of adapter 'a'", MixError),
    (100.00000000000001, "Weight 100.00000000000001 of adapter 'a'", MixError),
]


@pytest.mark.parametrize(("weight", "fragment", "err"), QUOTED, ids=[f"quoted{i}" for i in range(len(QUOTED))])
def test_a_weight_out_of_range_is_quoted_as_given(weight: Any, fragment: str, err: type[Exception]) -> None:
    with pytest.raises(err) as info:
        check_weight(weight, name="a")
    assert fragment in str(info.value) and "200" not in str(info.value), str(info.value)
    assert "Use a weight with |w| <= 100" in str(info.value)


@pytest.mark.parametrize(("text", "fragment"), [
    ("1e400", "Weight 1e400 of adapter 'a' is not finite"),
    ("500", "Weight 500 of adapter 'a' is outside"),
    ("1_000", "Weight '1_000' of adapter 'a' is not a number"),  # digit separators: '0_5' would be 5
    ("9" * 60, "Weight " + "9" * 37 + "... of adapter 'a' is outside"),
])
def test_a_weight_written_as_text_is_quoted_as_written(text: str, fragment: str) -> None:
    with pytest.raises(MixError, match="^" + fragment.replace("(", r"\(")):
        parse_mix_expression(f"a={text}+b")


def test_an_empty_weight_names_the_adapter_and_the_fix() -> None:
    with pytest.raises(MixError, match=r"gives adapter 'domain' an empty weight after '='.*without a '\+' sign"):
        parse_mix_expression("style=0.5+domain=+0")


# ------------------------------------------------------------------------------------------------ mix names (7)

def test_a_server_made_mix_name_spells_its_mix_out_again() -> None:
    spec = resolve_mix(["style", "domain"], [0.7, 0.3], sources=SOURCES, default_weights={})
    assert spec is not None
    assert mix_in_model(spec.lora_name, sources=SOURCES, default_weights={}) == (["style", "domain"], [0.7, 0.3])


@pytest.mark.parametrize("name", [
    "mix-style=0.7+domain=0.3-" + DIGEST,  # another digest: another mix, never this one
    "mix-style=0.7+nope=0.3-" + DIGEST,
    "mix-style=x+domain=0.3-" + DIGEST,
    "mix-style=0.7+domain=0.3",  # no digest
    "mix-" + "style=0.1+" * 9 + "...-" + DIGEST,
    "mix-style=0.7+domain=0.3-" + DIGEST.upper(),
])
def test_a_mix_name_that_cannot_be_made_again_is_not_found_naming_the_fix(name: str) -> None:
    with pytest.raises(AdapterNotFoundError, match="is not registered on this server.*Ask for the mix by its adapters"):
        mix_in_model(name, sources=SOURCES, default_weights={})


def test_a_mix_name_whose_sources_changed_is_not_made_again_for_the_new_sources() -> None:
    spec = resolve_mix(["style", "domain"], [0.7, 0.3], sources=SOURCES, default_weights={})
    moved = {**SOURCES, "style": "/m/style-v2"}  # 'style' re-registered from another folder since
    with pytest.raises(AdapterNotFoundError):
        mix_in_model(spec.lora_name, sources=moved, default_weights={})  # type: ignore[union-attr]


# ------------------------------------------------------------------------------------------------ Ray ids (7)

@pytest.mark.parametrize(("model_id", "fragment"), [
    ("qwen:hf:acme/a=1", "contains '='"),
    ("qwen:hf:acme/a+b", "contains '+'"),
    ("qwen:/loras/ckpt=5", "contains '='"),
    ("qwen:/loras/a+b=c", "contains '+' and '='"),
    ("mix-qwen:hf:acme/x", "starts with 'mix-'"),
])
def test_a_ray_id_naming_a_source_cannot_register_a_name_that_spells_a_mix(model_id: str, fragment: str) -> None:
    with pytest.raises(AdapterSourceError) as info:
        plan_model_id(model_id, names={"style"}, client_sources=("hf:acme/", "/loras/"))
    message = str(info.value)
    assert fragment in message and "deployment config (VLLM_LORA_EXT_CONFIG) under a name" in message, message


@pytest.mark.parametrize("adapter", ["style=0.7+domain=0.3", "style+domain", "mix-style", "mix-a=1-" + DIGEST])
def test_a_ray_id_spelling_a_mix_goes_to_the_plugins_mix_routing(adapter: str) -> None:
    got = plan_model_id(f"qwen:{adapter}", names={"style", "domain"}, client_sources=("hf:acme/",), ray_downloads=True)
    assert (got.plan, got.adapter) == (Plan.MIX, adapter)
