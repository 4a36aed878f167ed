"""Mix grammar, resolution rules, canonical keys and the rank-concatenation math (no vLLM)."""

from __future__ import annotations

import math

import pytest
import torch

from moe_factories import make_truth
from vllm_lora_ext.errors import MixError
from vllm_lora_ext.mixing import MixComponent, MixSpec, concat_factors, parse_mix_expression, resolve_mix

SOURCES = {"style": "hf:acme/style@" + "a" * 40, "domain": "hf:acme/domain@" + "b" * 40, "x": "/m/x"}
DEFAULTS = {"style": 0.7, "domain": 0.3}


def test_concatenation_equals_the_weighted_sum_of_deltas_mixed_ranks_and_negative_weights() -> None:
    g = torch.Generator().manual_seed(0)
    parts = [(torch.randn(r, 12, generator=g), torch.randn(9, r, generator=g), c) for r, c in ((2, 0.7 * 4.0),
                                                                                                (5, -0.3 * 0.5),
                                                                                                (3, 1.25))]
    a, b = concat_factors(parts)
    dense = sum(c * (bi @ ai) for ai, bi, c in parts)
    assert a.shape == (10, 12) and b.shape == (9, 10)
    torch.testing.assert_close(b @ a, dense, rtol=1e-5, atol=1e-5)


def test_per_expert_concatenation_is_exact_per_expert() -> None:
    t1, t2 = make_truth(4, 8, 6, 2, seed=1), make_truth(4, 8, 6, 3, seed=2)
    a, b = concat_factors([(t1.ad, t1.bd, 0.7), (t2.ad, t2.bd, 0.3)], rank_dim_a=1, rank_dim_b=2)
    for e in range(4):
        torch.testing.assert_close(b[e] @ a[e], 0.7 * t1.bd[e] @ t1.ad[e] + 0.3 * t2.bd[e] @ t2.ad[e], rtol=1e-5,
                                   atol=1e-6)


def test_concatenation_in_bf16_stays_within_bf16_rounding() -> None:
    g = torch.Generator().manual_seed(3)
    parts = [(torch.randn(4, 64, generator=g), torch.randn(32, 4, generator=g), 0.5),
             (torch.randn(8, 64, generator=g), torch.randn(32, 8, generator=g), 2.0)]
    a, b = concat_factors(parts, dtype=torch.bfloat16)
    dense = sum(c * (bi @ ai) for ai, bi, c in parts)
    err = ((b.float() @ a.float()) - dense).abs().max() / dense.abs().max()
    assert a.dtype == b.dtype == torch.bfloat16 and err < 2e-2


def test_a_composite_given_memory_is_written_there_and_equals_the_one_in_new_tensors() -> None:
    from vllm_lora_ext.mixing import concat_many

    g = torch.Generator().manual_seed(4)
    jobs = {m: ([(torch.randn(r, 16, generator=g).bfloat16(), torch.randn(8, r, generator=g).bfloat16(), c)
                 for r, c in ((2, 0.5), (3, -1.5))], 0, 1) for m in ("q", "v", "o")}
    given: list[torch.Tensor] = []

    def alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        given.append(torch.full(shape, float("nan"), dtype=dtype))  # every element must be written
        return given[-1]

    for workers in (1, 3):
        given.clear()
        got, want = concat_many(jobs, workers=workers, alloc=alloc), concat_many(jobs, workers=workers)
        assert {t.data_ptr() for ab in got.values() for t in ab} == {t.data_ptr() for t in given}
        assert all(torch.equal(x, y) for k in jobs for x, y in zip(got[k], want[k]))


@pytest.mark.parametrize(("expr", "parsed"), [
    ("style=0.7+domain=0.3", [("style", 0.7), ("domain", 0.3)]),
    ("style+domain", [("style", None), ("domain", None)]),
    ("a/b=-1.5", [("a/b", -1.5)]),
])
def test_parse_mix_expression(expr: str, parsed: list) -> None:
    assert parse_mix_expression(expr) == parsed


@pytest.mark.parametrize(("expr", "fragment"), [("a=0.7+", "empty adapter name"), ("a=x", "not a number"),
                                                ("a=nan", "finite"), ("a=inf+b", "finite")])
def test_bad_mix_expressions_are_refused(expr: str, fragment: str) -> None:
    with pytest.raises(MixError, match=fragment):
        parse_mix_expression(expr)


def test_resolution_rules() -> None:
    kw = {"sources": SOURCES, "default_weights": DEFAULTS}
    s = resolve_mix(["style", "domain"], [0.5, 0.5], **kw)
    assert s is not None and [c.weight for c in s.components] == [0.5, 0.5]
    s = resolve_mix(["style", "domain"], None, **kw)
    assert s is not None and [c.weight for c in s.components] == [0.7, 0.3]  # configured defaults
    assert resolve_mix(None, None, **kw) is None  # base model
    s = resolve_mix(None, None, default="style", **kw)
    assert s is not None and [(c.name, c.weight) for c in s.components] == [("style", 0.7)]
    s = resolve_mix(["x"], None, **kw)
    assert s is not None and s.components[0].weight == 1.0


@pytest.mark.parametrize(("adapters", "weights", "fragment"), [
    (["nope"], None, "Unknown adapter"), (["style"], [0.5, 0.5], "1 adapters but 2"),
    (["style"], [math.nan], "finite"), (None, [1.0], "without adapters"), (["style", "style"], None, "more than once"),
])
def test_resolution_errors(adapters: list | None, weights: list | None, fragment: str) -> None:
    with pytest.raises(MixError, match=fragment):
        resolve_mix(adapters, weights, sources=SOURCES, default_weights=DEFAULTS)


def test_equal_mixes_share_one_canonical_key_name_and_id() -> None:
    from vllm_lora_ext.registry import MixRegistry

    reg = MixRegistry(capacity=8)
    a = MixSpec((MixComponent("style", SOURCES["style"], 0.7), MixComponent("domain", SOURCES["domain"], 0.3)))
    b = resolve_mix(["style", "domain"], [0.70, 0.30], sources=SOURCES, default_weights={})
    assert b is not None and a.key == b.key and a.lora_name == b.lora_name
    assert reg.register(a)[0].lora_int_id == reg.register(b)[0].lora_int_id
    c = resolve_mix(["style", "domain"], [0.7, 0.31], sources=SOURCES, default_weights={})
    assert c is not None and c.lora_name != a.lora_name
    assert reg.register(c)[0].lora_int_id != reg.register(a)[0].lora_int_id
    assert (1 << 30) <= reg.register(a)[0].lora_int_id < (1 << 31)
    assert MixSpec.from_path(a.lora_path) == a
    moved = MixSpec((MixComponent("style", "hf:acme/style@" + "c" * 40, 0.7), MixComponent("domain", SOURCES["domain"], 0.3)))
    assert moved.lora_name != a.lora_name  # a new commit is a new composite (and a new prefix-cache key)


def test_mix_names_stay_readable_and_unique_for_path_like_names() -> None:
    a = MixSpec((MixComponent("/models/x/style-lora", "/models/x/style-lora", 0.7),
                 MixComponent("hf:acme/loras:domain.safetensors", "hf:acme/loras@" + "a" * 40 + ":domain.safetensors", 0.3)))
    assert a.lora_name.startswith("mix-style-lora=0.7+domain.safetensors=0.3-") and len(a.lora_name) < 120
    b = MixSpec((MixComponent("/other/style-lora", "/other/style-lora", 0.7), a.components[1]))
    assert a.lora_name != b.lora_name


def test_a_mix_plan_sums_ranks_per_module_and_refuses_past_the_budget_with_the_numbers_as_fields() -> None:
    from vllm_lora_ext.errors import AdapterCompatibilityError
    from vllm_lora_ext.mixing import MixFactor, MixPlan

    def dense(r: int) -> MixFactor:
        return MixFactor(torch.ones(r, 6), torch.ones(5, r), scaling=2.0, max_abs=1.0)

    packed = [MixFactor(torch.ones(4, r, 6), torch.ones(4, 5, r), rank_dim=1, max_abs=1.0) for r in (3, 9)]
    plan = MixPlan.from_components("m", [("a", 0.5, {"q": dense(4), "experts": packed}), ("b", -1.0, {"q": dense(8)})])
    assert list(plan.jobs) == ["q", ("experts", 0), ("experts", 1)] and plan.modules["q"] == ["q"]
    assert [c for _, _, c in plan.jobs["q"][0]] == [1.0, -2.0] and plan.jobs[("experts", 1)][1:] == (1, 2)
    assert (plan.rank("q"), plan.rank("experts")) == (12, 9)
    plan.check_rank_budget(12)
    with pytest.raises(AdapterCompatibilityError, match=r"needs rank 12 .* max_lora_rank is 8: q needs 12 "
                                                        r"\(a r=4, b r=8\)\. .*--max-lora-rank 16") as caught:
        plan.check_rank_budget(8)
    assert (caught.value.rank, caught.value.max_rank, caught.value.adapter) == (12, 8, "m")


def test_a_mix_plan_needs_a_scan_where_a_weighted_factor_could_overflow_or_its_bound_is_unknown() -> None:
    from vllm_lora_ext.mixing import MixFactor, MixPlan, largest_magnitude

    a = torch.full((2, 3), 300.0)
    known = MixFactor(a, torch.ones(4, 2), max_abs=largest_magnitude(a))
    plan = MixPlan.from_components("m", [("a", 100.0, {"q": known})])
    assert plan.stays_finite(torch.float16) and plan.stays_finite(None)  # 3e4 <= 65504 / 2; None: A's float32
    assert not MixPlan.from_components("m", [("a", -100.0, {"q": MixFactor(a * 10, torch.ones(4, 2), max_abs=3000.0)})
                                             ]).stays_finite(torch.float16)  # 3e5 > 65504 / 2
    assert not MixPlan.from_components("m", [("a", 1.0, {"q": MixFactor(a, torch.ones(4, 2))})]).stays_finite(None)
    assert math.isnan(largest_magnitude(torch.tensor([1.0, float("nan")])))
