"""ResidencyRequestRouter inside Ray Serve's own routing loop (``RequestRouter._choose_replica_for_request``: ranks
tried in order, queue lengths probed, a full replica passed over). The replicas are Serve's in-memory stand-ins
(``ray.serve._private.test_utils.FakeRunningReplica``): what each reports holding and its queue length.

Needs only ``ray[serve]`` (any Ray with the request-router API, 2.58 and 2.60 tried); skipped without Ray.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

try:
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
    from ray.serve._private.request_router import PendingRequest
    from ray.serve._private.test_utils import FakeRunningReplica

    from vllm_lora_ext.integration.ray_routing import ResidencyRequestRouter
    WHY = ""
except Exception as err:  # Ray missing
    WHY = f"{type(err).__name__}: {str(err)[:160]}"

pytestmark = pytest.mark.skipif(bool(WHY), reason=f"Ray Serve not importable: {WHY}")
FULL = 10  # FakeRunningReplica's max_ongoing_requests


def _replica(name: str, held: set[str], queue: int = 0) -> Any:
    replica = FakeRunningReplica(name, model_ids=held)
    replica.set_queue_len_response(queue)
    return replica


def _route(replicas: list[Any], model_ids: list[str], *, routed: list[tuple[str, Any]] = ()) -> list[str]:
    """Route one request per id through Serve's loop; return the chosen replicas' names."""

    async def run() -> list[str]:
        router = ResidencyRequestRouter(deployment_id=DeploymentID(name="llm"),
                                        handle_source=DeploymentHandleSource.UNKNOWN, self_actor_id="router",
                                        use_replica_queue_len_cache=False)
        router.initial_backoff_s = router.max_backoff_s = 0.001
        router.initialize_state()
        router.update_replicas(replicas)
        for model_id, replica in routed:
            router.on_request_routed(_request(model_id), replica.replica_id, None)
        out = []
        for model_id in model_ids:
            chosen = await asyncio.wait_for(router._choose_replica_for_request(_request(model_id)), 10)
            out.append(chosen.replica_id.unique_id)
        return out

    return asyncio.run(run())


def _request(model_id: str) -> Any:
    return PendingRequest(args=[], kwargs={}, metadata=RequestMetadata(
        request_id="r", internal_request_id=f"i-{model_id}", multiplexed_model_id=model_id))


def test_an_id_goes_to_the_replica_that_holds_it_every_time() -> None:
    replicas = [_replica("r1", {"q:b"}), _replica("r2", {"q:a"}), _replica("r3", set())]
    assert _route(replicas, ["q:a"] * 20) == ["r2"] * 20


def test_a_saturated_holder_hands_the_request_to_a_cold_replica() -> None:
    # r2 holds the id but its queue is full: Serve's rule passes it over for the coldest replica (r3)
    replicas = [_replica("r1", {"q:b", "q:c"}), _replica("r2", {"q:a"}, queue=FULL), _replica("r3", {"q:d"})]
    assert set(_route(replicas, ["q:a"] * 10)) == {"r3"}


def test_with_every_replica_full_but_one_the_request_still_lands() -> None:
    replicas = [_replica("r1", {"q:a"}, queue=FULL), _replica("r2", set(), queue=FULL), _replica("r3", {"q:x", "q:y"})]
    assert _route(replicas, ["q:a"]) == ["r3"]


def test_a_new_mix_goes_to_the_replica_holding_its_components() -> None:
    replicas = [_replica("r1", {"q:style"}), _replica("r2", {"q:style", "q:domain", "q:z"}), _replica("r3", set())]
    assert _route(replicas, ["q:style=0.7+domain=0.3"] * 5) == ["r2"] * 5
    replicas = [_replica("r1", {"q:style=0.7+domain=0.30"}), _replica("r2", {"q:style", "q:domain"})]
    assert _route(replicas, ["q:style=0.70+domain=0.3"]) == ["r1"]  # the same mix, written another way


def test_an_id_routed_a_moment_ago_counts_as_held_before_the_replica_reports_it() -> None:
    r1, r2 = _replica("r1", set()), _replica("r2", set())
    assert _route([r1, r2], ["q:new"] * 10, routed=[("q:new", r2)]) == ["r2"] * 10


def test_requests_without_an_adapter_id_use_serves_power_of_two_choice() -> None:
    replicas = [_replica("r1", {"q:a"}, queue=FULL), _replica("r2", set())]
    assert _route(replicas, [""] * 5) == ["r2"] * 5
