"""The residency routing plan (which replica takes an id) and the residency gauge's bound (pure, no Ray, no vLLM)."""

from __future__ import annotations

import pytest

from vllm_lora_ext.residency import adapter_id, adapter_levels, rank_replicas


@pytest.mark.parametrize("model_id, key, components", [
    ("q:style", "q:style", set()),
    ("q:style=0.70+domain=0.3", "q:style=0.7+domain=0.3", {"q:style", "q:domain"}),
    ("q:style+domain", "q:style+domain", {"q:style", "q:domain"}),
    ("q:hf:acme/loras@v1:a=b", "q:hf:acme/loras@v1:a=b", set()),  # a source is never a mix
    ("q:style=nan+domain", "q:style=nan+domain", set()),  # refused by its replica; routed as written
    ("q:", "q:", set()),
])
def test_ids_are_keyed_so_equal_mixes_match_and_mixes_know_their_components(
        model_id: str, key: str, components: set[str]) -> None:
    got = adapter_id(model_id)
    assert (got.key, set(got.components)) == (key, components)


def test_the_replica_holding_an_id_comes_first_then_the_coldest_then_the_rest() -> None:
    holdings = {"r1": ["q:b", "q:c"], "r2": ["q:a", "q:b", "q:c"], "r3": ["q:d"]}
    assert rank_replicas("q:a", holdings) == [["r2"], ["r3"], ["r1"]]
    # an id nobody holds: the replicas holding the fewest ids first (Serve's rule), then the rest
    assert rank_replicas("q:new", holdings) == [["r3"], ["r1", "r2"]]


def test_a_mix_written_another_way_is_the_same_mix() -> None:
    holdings = {"r1": ["q:a=0.5+b=0.50"], "r2": []}
    assert rank_replicas("q:a=0.5+b=0.5", holdings)[0] == ["r1"]


def test_a_new_mix_prefers_the_replica_holding_most_of_its_components() -> None:
    holdings = {"r1": ["q:a"], "r2": ["q:a", "q:b", "q:x", "q:y"], "r3": [], "r4": ["q:z"]}
    assert rank_replicas("q:a=0.7+b=0.3", holdings) == [["r2"], ["r1"], ["r3"], ["r4"]]
    # once a replica holds the mix itself, that one wins over component holders
    holdings["r4"].append("q:a=0.7+b=0.3")
    assert rank_replicas("q:a=0.7+b=0.3", holdings)[0] == ["r4"]


def test_every_candidate_is_ranked_once_in_the_given_order_and_unknown_ones_hold_nothing() -> None:
    holdings = {"r1": ["q:a"], "r2": ["q:a"]}
    ranks = rank_replicas("q:a", holdings, replicas=["r3", "r2", "r1", "r2"])
    assert ranks == [["r2", "r1"], ["r3"]]
    assert rank_replicas("q:a", {}) == [] and rank_replicas("q:a", {}, replicas=["r9"]) == [["r9"]]


def test_levels_report_each_adapter_once_at_its_highest_level() -> None:
    assert adapter_levels(gpu=["a"], cpu=["a", "b"], building=["b", "c"]) == {"a": "gpu", "b": "cpu", "c": "building"}
    assert adapter_levels() == {}
