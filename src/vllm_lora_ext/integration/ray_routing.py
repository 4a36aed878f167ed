"""A Ray Serve request router that sends each adapter id to the replica holding it (`vllm_lora_ext.residency`).

Ray Serve LLM routes ``model="<base>:<adapter>"`` as a multiplexed id. Serve's stock router prefers a replica
that reports the exact id, else the replica reporting the fewest ids. With `LoraExtLLMServer`, replicas report
the plugin's ids too (names, mixes, admitted client sources; see `vllm_lora_ext.integration.ray`), so the stock
router keeps a name or a mix on the replica that built it once the report is in. `ResidencyRequestRouter` adds
what the stock router cannot know, by the ranks of `vllm_lora_ext.residency`: a home replica for an id no replica
reports yet, and a mix no replica holds sent where its components are.

Saturation is Serve's own rule: `choose_replicas` returns ranks (`vllm_lora_ext.residency.rank_replicas`); Serve
tries them in order and takes the least-loaded replica of the first rank whose queue is below
``max_ongoing_requests``. When every holder is full, the next rank takes the request. Requests without a
multiplexed id (the base model, body-field mixes) go to Serve's power-of-two choice unchanged.

Use it as the deployment's request router::

    LLMConfig(..., server_cls=LoraExtLLMServer, lora_config={"max_num_adapters_per_replica": 64},
              deployment_config={"request_router_config": {
                  "request_router_class": "vllm_lora_ext.integration.ray_routing:ResidencyRequestRouter"}})

It subclasses Ray's ``PowerOfTwoChoicesRequestRouter`` (``ray.serve._private.request_router``, Serve's default
router) and imports ``ray.serve`` only, never Ray Serve LLM or vLLM. Besides the public hook ``choose_replicas`` it
overrides one private method, ``_fulfill_next_pending_request``: Serve's routing tasks are not tied to requests (a
task may route with no request of its own, or leave its request to another task), and Serve's FIFO rule hands the
replica a task chose to the oldest waiting request of any id, which spreads a burst of new ids over replicas; Ray
2.60 ties each task to its request but, when the replica went to an older request, goes on to the request's next
rank. Here a replica goes to the request it was chosen for, else to the oldest request of the same id, else to the
oldest request whose first rank holds it (a request without an id takes any); otherwise to none, and the requests
wait for the next task. The private names it reads are checked at import (`RAY_PRIVATE`): a Ray that renames one
fails the import, loudly.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

try:
    from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
except ImportError as err:  # pragma: no cover - only without Ray
    raise ImportError(f"vllm_lora_ext.integration.ray_routing needs Ray Serve ({err}). Install it with: "
                      "pip install 'ray[serve]'.") from err

from vllm_lora_ext.residency import rank_replicas

__all__ = ["RAY_PRIVATE", "ResidencyRequestRouter"]

# Ray's private router methods this module overrides or calls (instance attributes: _pending_requests_to_fulfill,
# _replicas_list); Ray 2.58 and 2.60 have them all
RAY_PRIVATE = ("_fulfill_next_pending_request", "_get_pending_request_matching_internal_request_id",
               "_get_pending_request_matching_metadata", "_record_queue_wait_time", "_remove_pending_request_from_indices")
_missing = [name for name in RAY_PRIVATE if not callable(getattr(PowerOfTwoChoicesRequestRouter, name, None))]
if _missing:
    raise ImportError(f"vllm_lora_ext.integration.ray_routing: this Ray's request router lacks {_missing}, which "
                      "residency routing relies on. Use Ray 2.58-2.60, or drop request_router_config from the "
                      "deployment (requests are then routed by Serve's default router).")


class ResidencyRequestRouter(PowerOfTwoChoicesRequestRouter):  # type: ignore[misc]
    """Serve's power-of-two router whose multiplexed requests go to the replica holding their adapter or mix."""

    async def choose_replicas(self, candidate_replicas: list[Any],
                              pending_request: Any = None) -> list[list[Any]]:
        if pending_request is None:  # a routing task with no request of its own routes the oldest one waiting
            pending_request = self._oldest_waiting()
            if pending_request is not None:
                self._routing_for()[asyncio.current_task()] = pending_request
        model_id = getattr(getattr(pending_request, "metadata", None), "multiplexed_model_id", "")
        if not model_id or not candidate_replicas:
            return list(await super().choose_replicas(candidate_replicas, pending_request))
        # Every candidate is in some rank: when all are full, back off before the next round (as Serve's does).
        pending_request.routing_context.should_backoff = True
        by_id = {str(r.replica_id): r for r in candidate_replicas}
        return [[by_id[i] for i in rank] for rank in self._ranks(model_id, candidate_replicas)]

    def _fulfill_next_pending_request(self, replica: Any, request_metadata: Any = None) -> None:
        """Hand ``replica`` to a request it suits (see the module docstring), never to another id's request."""
        if request_metadata is None:  # the oldest request, if this task chose for it (see choose_replicas)
            own = self._routing_for().pop(asyncio.current_task(), None)
        else:
            own = self._get_pending_request_matching_internal_request_id(request_metadata)
        pending = own if own is not None and not own.future.done() else None
        if pending is None:
            pending = self._get_pending_request_matching_metadata(request_metadata)  # the same id, oldest first
        if pending is None:
            pending = next((p for p in self._pending_requests_to_fulfill
                            if not p.future.done() and self._suits(p, replica)), None)
        if pending is None:
            return
        self._record_queue_wait_time(pending)
        pending.future.set_result(replica)
        self._remove_pending_request_from_indices(pending)

    def _ranks(self, model_id: str, candidates: list[Any]) -> list[list[str]]:
        # Serve's replica ids print the same in every process (unique id, deployment, app): the home hash's input
        return rank_replicas(model_id, {str(r.replica_id): r.multiplexed_model_ids for r in candidates})

    def _suits(self, pending: Any, replica: Any) -> bool:
        model_id = pending.metadata.multiplexed_model_id
        return not model_id or str(replica.replica_id) in self._ranks(model_id, list(self._replicas_list))[0]

    def _oldest_waiting(self) -> Any:
        return next((p for p in self._pending_requests_to_fulfill if not p.future.done()), None)

    def _routing_for(self) -> weakref.WeakKeyDictionary[Any, Any]:
        """The request each routing task without one of its own chose a replica for (gone with the task)."""
        table = self.__dict__.get("_lora_ext_routing_for")
        if table is None:
            table = self.__dict__["_lora_ext_routing_for"] = weakref.WeakKeyDictionary()
        return table
