"""plan_adapter: every key routed to the model, every check made, before a tensor is read (no vLLM)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from vllm_lora_ext.config import config_from_dict
from vllm_lora_ext.errors import AdapterCompatibilityError, AdapterFormatError, ExpertLayoutError, UnmatchedKeysError
from vllm_lora_ext.formats.moe import MoESpec
from vllm_lora_ext.planning import ModelSpec, PeftKeyRouter, plan_adapter
from vllm_lora_ext.validation import ModuleDims, check_has_factors

P = "base_model.model."
MOE = "model.layers.0.block_sparse_moe.experts"  # vLLM's Mixtral name
SPEC = ModelSpec(
    accepted=frozenset({"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", MOE}),
    dims={"model.layers.0.self_attn.q_proj": ModuleDims(16, 16), "model.layers.0.self_attn.v_proj": ModuleDims(16, 8)},
    moe={MOE: MoESpec(MOE, 4, 16, 6, gate="w1", up="w3", down="w2")}, max_rank=16)


def _dense(module: str, r: int = 4, d_in: int = 16, d_out: int = 16) -> dict[str, tuple[int, ...]]:
    return {f"{P}{module}.lora_A.weight": (r, d_in), f"{P}{module}.lora_B.weight": (d_out, r)}


def _plan(shapes: dict[str, tuple[int, ...]], **kw: object) -> object:
    return plan_adapter(shapes, config_from_dict({"r": 4, "lora_alpha": 8}), SPEC, router=PeftKeyRouter(), name="x",
                        **kw)  # type: ignore[arg-type]


def test_dense_keys_are_routed_and_moe_keys_of_a_v5_block_name_go_to_the_layers_moe_block() -> None:
    shapes = {**_dense("model.layers.0.self_attn.q_proj"), **_dense("model.layers.0.self_attn.v_proj", d_out=8),
              f"{P}model.layers.0.mlp.experts.1.w1.lora_A.weight": (4, 16),
              f"{P}model.layers.0.mlp.experts.1.w1.lora_B.weight": (6, 4)}
    plan = _plan(shapes)
    assert plan.dense_keys == list(shapes)[:4]  # type: ignore[attr-defined]
    assert set(plan.moe) == {MOE} and [k.expert for k in plan.moe[MOE].keys_2d] == [1]  # type: ignore[attr-defined]


def test_keys_matching_nothing_are_all_listed_or_dropped_when_allowed() -> None:
    shapes = {**_dense("model.layers.0.self_attn.q_proj"), **_dense("model.layers.0.self_attn.x_proj"),
              f"{P}model.layers.0.mlp.other": (1,)}
    with pytest.raises(UnmatchedKeysError) as e:
        _plan(shapes)
    assert len(e.value.keys) == 3 and "x_proj" in str(e.value)
    plan = plan_adapter(shapes, config_from_dict({"r": 4, "lora_alpha": 8}), replace(SPEC, allow_unmatched=True),
                        router=PeftKeyRouter(), name="x")
    assert len(plan.dropped) == 3 and all("x_proj" not in k for k in plan.dense_keys)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("shapes", "kw", "err", "fragment"), [
    (_dense("model.layers.0.self_attn.q_proj", r=32), {}, AdapterCompatibilityError, "--max-lora-rank 32"),
    (_dense("model.layers.0.self_attn.v_proj", d_out=16), {}, AdapterFormatError, "maps 16 -> 8"),
    (_dense("model.layers.0.self_attn.q_proj"), {"dtypes": {f"{P}model.layers.0.self_attn.q_proj.lora_A.weight":
                                                            "F8_E4M3"}}, AdapterFormatError, "F8_E4M3"),
    ({f"{P}{MOE}.9.w1.lora_A.weight": (4, 16), f"{P}{MOE}.9.w1.lora_B.weight": (6, 4)}, {}, ExpertLayoutError,
     "expert 9 out of range"),
])
def test_every_check_runs_before_anything_is_read(shapes: dict, kw: dict, err: type, fragment: str) -> None:
    with pytest.raises(err, match=fragment):
        _plan(shapes, **kw)


class _AskedRouter(PeftKeyRouter):
    """PEFT's naming, counting the keys it is asked about; ``alike`` says whether it routes experts alike."""

    def __init__(self, alike: bool, drop: str | None = None) -> None:
        self.alike, self.drop, self.asked = alike, drop, 0

    def skip(self, key: str) -> bool:
        return False

    def module(self, key: str) -> str | None:
        self.asked += 1
        return None if self.drop is not None and self.drop in key else super().module(key)

    def routes_experts_alike(self) -> bool:
        return self.alike


def _experts(n: int = 4, *, prefix: str = f"{P}{MOE}") -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for e in range(n):
        for proj, (d_in, d_out) in {"w1": (16, 6), "w2": (6, 16), "w3": (16, 6)}.items():
            shapes[f"{prefix}.{e}.{proj}.lora_A.weight"] = (4, d_in)
            shapes[f"{prefix}.{e}.{proj}.lora_B.weight"] = (d_out, 4)
    return shapes


def test_a_router_that_routes_experts_alike_is_asked_once_per_block_projection_and_factor() -> None:
    from vllm_lora_ext.formats import classify_key
    from vllm_lora_ext.planning import expert_pattern

    shapes = {**_dense("model.layers.0.self_attn.q_proj"), **_experts()}
    plans = {}
    for alike in (False, True):
        router = _AskedRouter(alike)
        plans[alike] = plan_adapter(shapes, config_from_dict({"r": 4, "lora_alpha": 8}), SPEC, router=router)
        assert router.asked == (2 + 6 + 1 if alike else len(shapes) + 1)  # (+1: the block's own name, once)
    assert plans[True] == plans[False]
    # the pattern splits around the expert number only, leading zeros and many digits included
    for key in (f"{P}{MOE}.007.w1.lora_A.weight", f"{MOE}.12345.w3.lora_B.weight"):
        head, tail = expert_pattern(key, classify_key(key))  # type: ignore[misc]
        assert key.startswith(head) and key.endswith(tail) and key[len(head):len(key) - len(tail)].isdecimal()
        assert head.endswith(".experts.") and tail.startswith(".w")
    assert expert_pattern(f"{P}{MOE}.lora_A.weight", classify_key(f"{P}{MOE}.lora_A.weight")) is None  # 3D


def test_keys_a_router_refuses_are_refused_all_alike_when_it_routes_experts_alike() -> None:
    shapes = {**_dense("model.layers.0.self_attn.q_proj"), **_experts()}
    for alike in (False, True):
        with pytest.raises(UnmatchedKeysError) as e:
            plan_adapter(shapes, config_from_dict({"r": 4}), SPEC, router=_AskedRouter(alike, drop=".w2."))
        assert sorted(e.value.keys) == sorted(k for k in shapes if ".w2." in k)  # all eight, either way


def test_the_no_factor_check_stops_at_the_first_factor_and_still_counts_a_file_without_one() -> None:
    """The plan classifies a 2D MoE adapter's ~10^4 keys in one pass later; this check must not classify them all
    one by one first (a cold build process paid 0.05 s of a 48-layer build for it)."""
    def keys() -> Iterator[str]:
        yield "model.norm.weight"
        yield "base_model.model.model.layers.0.mlp.experts.3.up_proj.lora_A.weight"
        raise AssertionError("read past the first factor")

    check_has_factors(keys())
    with pytest.raises(AdapterFormatError, match="has 3 tensors, none a lora_A"):
        check_has_factors(iter(["model.norm.weight", "lm_head.weight", "x"]), adapter="x")


def test_factors_under_peft_s_adapter_name_are_named_with_the_fix() -> None:
    """A PeftModel's state_dict() names its factors ``lora_A.default.weight``: it was told it held "no lora_A/lora_B
    factor" and, for each key, to remove it from the file."""
    from vllm_lora_ext.validation import not_lora_reason

    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    with pytest.raises(AdapterFormatError) as err:
        check_has_factors([key, key.replace("lora_A", "lora_B")], adapter="x")
    assert str(err.value) == (
        f"Adapter 'x' holds no LoRA factor under the names vLLM and PEFT load: 2 of its 2 tensors are factors whose "
        f"keys (first: {key!r}) carry PEFT's adapter name 'default' after lora_A, as a PeftModel's state_dict() "
        f"names them: save the adapter with PeftModel.save_pretrained(folder), or drop '.default' from every key.")
    with pytest.raises(AdapterFormatError) as err:  # the whole model's state_dict(): sorted, a base weight first
        check_has_factors(["base_model.model.lm_head.weight", key, "base_model.model.model.norm.weight"])
    assert f"1 of its 3 tensors are factors whose keys (first: {key!r})" in str(err.value)
    assert "The other 2 tensors are no LoRA factors (the base model's weights?)" in str(err.value)
    assert "drop '.sql' from every key" in not_lora_reason("m.embed_tokens.lora_embedding_B.sql")
    assert not_lora_reason("m.q_proj.weight") == "only lora_A/lora_B factors are served; remove it from the weight file"


def test_a_module_packed_as_itself_is_no_conflict_but_a_packed_module_beside_its_parts_is() -> None:
    """Phi-3 packs ``qkv_proj`` as ``["qkv_proj"]``: its adapters give ``qkv_proj`` alone, which is fine."""
    from vllm_lora_ext.errors import AdapterFormatError
    from vllm_lora_ext.validation import check_dense_factors

    def keys(module: str, out: int) -> dict[str, tuple[int, ...]]:
        return {f"{module}.lora_A.weight": (4, 16), f"{module}.lora_B.weight": (out, 4)}

    phi3 = keys("m.qkv_proj", 48)
    check_dense_factors(phi3, list(phi3), packed={"m.qkv_proj": ("m.qkv_proj",)})
    llama = {**keys("m.qkv_proj", 48), **keys("m.k_proj", 16)}
    with pytest.raises(AdapterFormatError, match=r"m.qkv_proj: given both as the packed module and as its parts "
                                                 r"\['m.k_proj'\]"):
        check_dense_factors(llama, list(llama), packed={"m.qkv_proj": ("m.q_proj", "m.k_proj", "m.v_proj")})
