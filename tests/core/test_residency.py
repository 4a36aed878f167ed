"""The residency routing plan (which replica takes an id) and the residency gauge's bound (pure, no Ray, no vLLM)."""

from __future__ import annotations

import pytest

import random
import statistics

from vllm_lora_ext.residency import adapter_id, adapter_levels, home_order, rank_replicas


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


def test_the_replica_holding_an_id_comes_first_then_every_other_in_the_ids_home_order() -> None:
    holdings = {"r1": ["q:b", "q:c"], "r2": ["q:a", "q:b", "q:c"], "r3": ["q:d"]}
    ranks = rank_replicas("q:a", holdings)
    assert ranks[0] == ["r2"] and ranks[1:] == [[r] for r in home_order("q:a", ["r1", "r3"])]
    # an id nobody holds: one replica per rank, its home first, whatever the replicas hold
    assert rank_replicas("q:new", holdings) == [[r] for r in home_order("q:new", ["r1", "r2", "r3"])]


def test_an_ids_home_is_the_same_in_any_order_and_a_leaving_replica_moves_only_its_own_ids() -> None:
    replicas = [f"r{i}" for i in range(4)]
    ids = [f"q:a{i:02d}" for i in range(200)]
    homes = {i: home_order(i, replicas)[0] for i in ids}
    assert all(home_order(i, replicas[::-1])[0] == homes[i] for i in ids)
    assert min(list(homes.values()).count(r) for r in replicas) >= 30  # spread: 50 each on average
    moved = [i for i in ids if home_order(i, replicas[:3])[0] != homes[i]]
    assert moved and all(homes[i] == "r3" for i in moved)


def test_a_mix_written_another_way_is_the_same_mix() -> None:
    holdings = {"r1": ["q:a=0.5+b=0.50"], "r2": []}
    assert rank_replicas("q:a=0.5+b=0.5", holdings)[0] == ["r1"]


def test_a_new_mix_prefers_the_replica_holding_most_of_its_components_else_its_first_components_home() -> None:
    holdings = {"r1": ["q:a"], "r2": ["q:a", "q:b", "q:x", "q:y"], "r3": [], "r4": ["q:z"]}
    ranks = rank_replicas("q:a=0.7+b=0.3", holdings)
    assert ranks[:2] == [["r2"], ["r1"]] and sorted(ranks[2:]) == [["r3"], ["r4"]]
    # once a replica holds the mix itself, that one wins over component holders
    holdings["r4"].append("q:a=0.7+b=0.3")
    assert rank_replicas("q:a=0.7+b=0.3", holdings)[0] == ["r4"]
    # nothing held: the mix goes where its first component goes, so a burst of both lands on one replica
    empty = {f"r{i}": [] for i in range(8)}
    assert rank_replicas("q:a=0.7+b=0.3", empty)[0] == rank_replicas("q:a", empty)[0]
    assert adapter_id("q:a=0.7+b=0.3").home_key == "q:a" and adapter_id("q:a").home_key == "q:a"


def test_every_candidate_is_ranked_once_and_unknown_ones_hold_nothing() -> None:
    holdings = {"r1": ["q:a"], "r2": ["q:a"]}
    ranks = rank_replicas("q:a", holdings, replicas=["r3", "r2", "r1", "r2"])
    assert ranks == [["r2", "r1"], ["r3"]]
    assert rank_replicas("q:a", {}) == [] and rank_replicas("q:a", {}, replicas=["r9"]) == [["r9"]]


def _builds_per_id(route: str, *, seed: int = 0) -> float:
    """Replay a Zipf workload (20 adapters, 10 two-adapter mixes, 400 requests, 2 replicas) in bursts of 32
    routed before any replica reports (reports land between bursts, as Serve's 0.1 s push does); a mix builds
    its missing components where it lands. Returns builds per requested id, components counted."""
    rng = random.Random(seed)
    names = [f"q:a{i:02d}" for i in range(20)]
    mixes = []
    while len(mixes) < 10:
        a, b = rng.sample(names, 2)
        mixes.append(f"{a}=0.7+{b[2:]}=0.3")
    ids = names + mixes
    rng.shuffle(ids)
    requests = rng.choices(ids, weights=[1 / (k + 1) ** 1.1 for k in range(len(ids))], k=400)
    reported: dict[str, set[str]] = {"r1": set(), "r2": set()}
    built = {r: set(v) for r, v in reported.items()}
    for start in range(0, len(requests), 32):
        for model_id in requests[start:start + 32]:
            if route == "residency":
                replica = rank_replicas(model_id, reported)[0][0]
            else:  # Serve's stock rule: a holder, else the replica reporting the fewest ids (ties: random)
                holders = [r for r in reported if model_id in reported[r]]
                fewest = min(len(v) for v in reported.values())
                replica = rng.choice(holders or [r for r in reported if len(reported[r]) == fewest])
            built[replica] |= {model_id} | set(adapter_id(model_id).components)
        reported = {r: set(v) for r, v in built.items()}
    requested = set(requests) | {c for m in requests for c in adapter_id(m).components}
    return statistics.mean(sum(i in b for b in built.values()) for i in requested)


def test_bursts_of_first_requests_build_each_id_about_once_with_residency_routing() -> None:
    # the H200 run of Serve's stock rule with the plugin's reports: 1.53 builds per id (1.97 unreported)
    ours = [_builds_per_id("residency", seed=s) for s in range(5)]
    stock = [_builds_per_id("fewest", seed=s) for s in range(5)]
    assert statistics.mean(ours) <= 1.1 < 1.2 < statistics.mean(stock)  # issue 40: <= 1.1 builds per id
    assert min(ours) >= 1.0


def test_levels_report_each_adapter_once_at_its_highest_level() -> None:
    assert adapter_levels(gpu=["a"], cpu=["a", "b"], building=["b", "c"]) == {"a": "gpu", "b": "cpu", "c": "building"}
    assert adapter_levels() == {}
