"""A Ray Serve request router that sends each adapter id to the replica holding it (`vllm_lora_ext.residency`).

Ray Serve LLM routes ``model="<base>:<adapter>"`` as a multiplexed id. Serve's stock router prefers a replica
that reports the exact id, else the replica reporting the fewest ids. With `LoraExtLLMServer`, replicas report
the plugin's ids too (names, mixes, admitted client sources; see `vllm_lora_ext.integration.ray`), so the stock
router already keeps a name or a mix on the replica that built it. `ResidencyRequestRouter` adds what the stock
router cannot know:

* a mix no replica holds goes to the replica holding most of its components (``a=0.7+b=0.3`` where ``a`` and
  ``b`` are hot), and a mix written another way (``a=0.70+b=0.3``) is the same mix;
* an id this router sent to a replica in the last ``RECENT_S`` seconds counts as held there before the replica's
  report arrives, so a burst of first requests for one id does not build it on every replica.

Saturation is Serve's own rule: `choose_replicas` returns ranks (`vllm_lora_ext.residency.rank_replicas`); Serve
tries them in order and takes the least-loaded replica of the first rank whose queue is below
``max_ongoing_requests``. When every holder is full, the next rank, a cold replica, takes the request. Requests
without a multiplexed id (the base model, body-field mixes) go to Serve's power-of-two choice unchanged.

Use it as the deployment's request router::

    LLMConfig(..., server_cls=LoraExtLLMServer, lora_config={"max_num_adapters_per_replica": 64},
              deployment_config={"request_router_config": {
                  "request_router_class": "vllm_lora_ext.integration.ray_routing:ResidencyRequestRouter"}})

It subclasses Ray's ``PowerOfTwoChoicesRequestRouter`` (``ray.serve._private.request_router``, Serve's default
router) and overrides only the public router hooks ``choose_replicas``, ``on_request_routed`` and
``initialize_state``; it imports ``ray.serve`` only, never Ray Serve LLM or vLLM.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

try:
    from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
except ImportError as err:  # pragma: no cover - only without Ray
    raise ImportError(f"vllm_lora_ext.integration.ray_routing needs Ray Serve ({err}). Install it with: "
                      "pip install 'ray[serve]'.") from err

from vllm_lora_ext.residency import rank_replicas

__all__ = ["ResidencyRequestRouter", "RECENT_S", "MAX_RECENT"]

# How long an id this router routed counts as held by that replica before the replica reports it (Serve pushes
# multiplexed ids every 0.1 s; the controller's broadcast adds its own delay).
RECENT_S = 10.0
MAX_RECENT = 4096  # bounded memory in the router: one entry per (id, replica) routed in the last RECENT_S


class ResidencyRequestRouter(PowerOfTwoChoicesRequestRouter):  # type: ignore[misc]
    """Serve's power-of-two router whose multiplexed requests go to the replica holding their adapter or mix."""

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self.recent_s = float(kwargs.get("recent_s", RECENT_S))
        self._routed: OrderedDict[tuple[str, Any], float] = OrderedDict()  # (model id, replica id) -> when

    async def choose_replicas(self, candidate_replicas: list[Any],
                              pending_request: Any = None) -> list[list[Any]]:
        model_id = getattr(getattr(pending_request, "metadata", None), "multiplexed_model_id", "")
        if not model_id or not candidate_replicas:
            return list(await super().choose_replicas(candidate_replicas, pending_request))
        holdings = {r.replica_id: set(r.multiplexed_model_ids) for r in candidate_replicas}
        for (held_id, replica_id), _ in self._recent():
            if replica_id in holdings:
                holdings[replica_id].add(held_id)
        by_id = {r.replica_id: r for r in candidate_replicas}
        # Every candidate is in some rank: when all are full, back off before the next round (as Serve's does).
        pending_request.routing_context.should_backoff = True
        return [[by_id[i] for i in rank] for rank in rank_replicas(model_id, holdings)]

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        model_id = getattr(getattr(pending_request, "metadata", None), "multiplexed_model_id", "")
        if model_id:
            key = (model_id, replica_id)
            self._state()[key] = time.monotonic()
            self._routed.move_to_end(key)
            while len(self._routed) > MAX_RECENT:
                self._routed.popitem(last=False)

    def _state(self) -> OrderedDict[tuple[str, Any], float]:
        if not hasattr(self, "_routed"):  # a Serve that never called initialize_state
            self.initialize_state()
        return self._routed

    def _recent(self) -> list[tuple[tuple[str, Any], float]]:
        routed, cutoff = self._state(), time.monotonic() - self.recent_s
        while routed and next(iter(routed.values())) < cutoff:
            routed.popitem(last=False)
        return list(routed.items())
