"""A Ray Serve request router that sends each adapter id to the replica holding it (`vllm_lora_ext.residency`).

Ray Serve LLM routes ``model="<base>:<adapter>"`` as a multiplexed id. Serve's stock router prefers a replica
that reports the exact id, else the replica reporting the fewest ids. With `LoraExtLLMServer`, replicas report
the plugin's ids too (names, mixes, admitted client sources; see `vllm_lora_ext.integration.ray`), so the stock
router keeps a name or a mix on the replica that built it once the report is in. `ResidencyRequestRouter` adds
what the stock router cannot know:

* an id no replica reports yet goes to its home replica (a rendezvous hash of the id over the replicas), so the
  first requests of an id, which all arrive before the replica that builds it reports it, land on one replica,
  and the routers of several proxies (one per node) pick the same one. Before, such a burst went by the fewest
  ids reported and a per-router memory of ids routed, entered only after a replica accepted a request, so it
  reached both replicas of an H200 run: 1.53 builds per id;
* a mix no replica holds goes to the replica holding most of its components (``a=0.7+b=0.3`` where ``a`` and
  ``b`` are hot), else to its first component's home; a mix written another way (``a=0.70+b=0.3``) is the same
  mix.

Saturation is Serve's own rule: `choose_replicas` returns ranks (`vllm_lora_ext.residency.rank_replicas`); Serve
tries them in order and takes the least-loaded replica of the first rank whose queue is below
``max_ongoing_requests``. When every holder is full, the next rank takes the request. Requests without a
multiplexed id (the base model, body-field mixes) go to Serve's power-of-two choice unchanged.

Use it as the deployment's request router::

    LLMConfig(..., server_cls=LoraExtLLMServer, lora_config={"max_num_adapters_per_replica": 64},
              deployment_config={"request_router_config": {
                  "request_router_class": "vllm_lora_ext.integration.ray_routing:ResidencyRequestRouter"}})

It subclasses Ray's ``PowerOfTwoChoicesRequestRouter`` (``ray.serve._private.request_router``, Serve's default
router) and overrides only the public router hook ``choose_replicas``; it imports ``ray.serve`` only, never Ray
Serve LLM or vLLM.
"""

from __future__ import annotations

from typing import Any

try:
    from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
except ImportError as err:  # pragma: no cover - only without Ray
    raise ImportError(f"vllm_lora_ext.integration.ray_routing needs Ray Serve ({err}). Install it with: "
                      "pip install 'ray[serve]'.") from err

from vllm_lora_ext.residency import rank_replicas

__all__ = ["ResidencyRequestRouter"]


class ResidencyRequestRouter(PowerOfTwoChoicesRequestRouter):  # type: ignore[misc]
    """Serve's power-of-two router whose multiplexed requests go to the replica holding their adapter or mix."""

    async def choose_replicas(self, candidate_replicas: list[Any],
                              pending_request: Any = None) -> list[list[Any]]:
        model_id = getattr(getattr(pending_request, "metadata", None), "multiplexed_model_id", "")
        if not model_id or not candidate_replicas:
            return list(await super().choose_replicas(candidate_replicas, pending_request))
        # Serve's replica ids print the same in every process (unique id, deployment, app): the home hash's input
        holdings = {str(r.replica_id): r.multiplexed_model_ids for r in candidate_replicas}
        by_id = {str(r.replica_id): r for r in candidate_replicas}
        # Every candidate is in some rank: when all are full, back off before the next round (as Serve's does).
        pending_request.routing_context.should_backoff = True
        return [[by_id[i] for i in rank] for rank in rank_replicas(model_id, holdings)]
