"""`vllm serve` with a mix registry of 2 slots and no wait for a slot, through the real `openai` client (issue 35).

A slot left held by a request that never generates would make the next new mix a 503 at once
(``VLLM_LORA_EXT_MIX_WAIT_S=0``). So:

1. ``/tokenize`` on 12 distinct mixes answers the base model's tokens, and 12 too-long prompts on 12 other
   mixes are each a 400; then two new mixes sent together are both served: every slot was free;
2. beam search on a mix, while 24 requests over distinct mixes press on the 2 slots, returns the same
   beams as the same request alone; then a new mix is served at once.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from serving import dense_deployment, http_module, vllm_serve
from tiny import prompts

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

ADAPTERS = ("a", "b")
MAX_LEN = 64


@pytest.fixture(scope="module")
def server(gpu_workdir: Path) -> Any:
    model, roots, deploy = dense_deployment(gpu_workdir, "leases", dict.fromkeys(ADAPTERS, 1.0),
                                            seed=20, targets=["q_proj", "v_proj", "down_proj"])
    env = dict(os.environ, VLLM_LORA_EXT_CONFIG=str(deploy), VLLM_LORA_EXT_MAX_MIXES="2", VLLM_LORA_EXT_MIX_WAIT_S="0")
    args = ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "2", "--max-cpu-loras", "4", "--enforce-eager",
            "--gpu-memory-utilization", "0.3", "--max-model-len", str(MAX_LEN), "--dtype", "bfloat16", "--seed", "0"]
    with vllm_serve(model, args, env=env, log_path=gpu_workdir / "leases-serve.log",
                    keep_log_as="leases-serve.log") as srv:
        yield {**srv, "model": str(model)}


def _client(base: str) -> Any:
    import openai

    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)


async def _status(call: Any) -> tuple[int, Any]:
    import openai

    try:
        return 200, await call
    except openai.APIStatusError as err:
        return int(err.status_code), str(err)


def _mix(i: int) -> dict[str, Any]:
    return {"adapters": list(ADAPTERS), "adapter_weights": [0.5, round(-0.9 + i / 100, 4)]}


async def _complete(client: Any, model: str, i: int, prompt: list[int], **extra: Any) -> tuple[int, Any]:
    body = {**_mix(i), **extra.pop("extra_body", {})}
    return await _status(client.completions.create(model=model, prompt=prompt, max_tokens=extra.pop("max_tokens", 4),
                                                   temperature=0.0, extra_body=body, **extra))


def test_tokenize_and_too_long_prompts_on_mixes_leave_every_slot_free(server: Any, record: Any) -> None:
    base, model = server["base"], server["model"]

    async def run() -> dict[str, Any]:
        http = http_module()
        async with http.AsyncClient(timeout=300) as raw:
            async def tokenize(body: dict[str, Any]) -> tuple[int, Any]:
                r = await raw.post(f"{base}/tokenize", content=json.dumps({"prompt": "hello mixes", **body}).encode(),
                                   headers={"Content-Type": "application/json"})
                return int(r.status_code), r.json()

            plain = await tokenize({"model": model})
            mixed = await asyncio.gather(*(tokenize({"model": f"a=0.5+b={i / 10}"}) for i in range(1, 7)),
                                         *(tokenize({"model": model, **_mix(i)}) for i in range(7, 13)))
        client = _client(base)
        too_long = [1] + [5] * (MAX_LEN + 8)
        # One at a time: at once, 12 new mixes race for 2 slots with MIX_WAIT_S=0 and most get a 503 while the
        # others hold the slots for the moment their length check takes (seen on an H200); the point here is
        # that each refused request frees its slot, so the next new mix always gets one.
        refused = [await _complete(client, model, 20 + i, too_long) for i in range(12)]
        fresh = await asyncio.gather(*(_complete(client, model, 50 + i, prompts(n=1, seed=3)[0]) for i in range(2)))
        return {"plain": plain, "mixed": mixed, "refused": refused, "fresh": fresh}

    out = asyncio.run(run())
    record("leases_tokenize_too_long", {"tokenize": [s for s, _ in out["mixed"]], "too_long": [s for s, _ in out["refused"]],
                                        "fresh": [s for s, _ in out["fresh"]],
                                        "too_long_message": str(out["refused"][0][1])[:300]})
    assert out["plain"][0] == 200
    assert all(s == 200 and body["tokens"] == out["plain"][1]["tokens"] for s, body in out["mixed"]), out["mixed"][:2]
    assert [s for s, _ in out["refused"]] == [400] * 12, out["refused"][:2]
    assert [s for s, _ in out["fresh"]] == [200, 200], out["fresh"]  # both slots were free at once


def test_beam_search_on_a_mix_under_eviction_pressure_returns_the_same_beams_as_alone(server: Any,
                                                                                         record: Any) -> None:
    base, model = server["base"], server["model"]
    prompt = prompts(n=1, seed=7)[0]
    beam = {"n": 3, "max_tokens": 6, "extra_body": {"use_beam_search": True, "ignore_eos": True}}

    async def run() -> dict[str, Any]:
        client = _client(base)
        alone = await _complete(client, model, 90, prompt, **beam)
        task = asyncio.create_task(_complete(client, model, 90, prompt, **beam))
        await asyncio.sleep(0.05)  # the beam request is routed first; then 24 distinct mixes press on the 2 slots
        pressure = await asyncio.gather(*(_complete(client, model, 100 + i, prompt, max_tokens=2) for i in range(24)))
        pressed = await task
        after = await _complete(client, model, 200, prompt)
        return {"alone": alone, "pressed": pressed, "pressure": pressure, "after": after}

    out = asyncio.run(run())
    assert out["alone"][0] == 200 and out["pressed"][0] == 200, (out["alone"], out["pressed"])
    beams = {k: [c.text for c in out[k][1].choices] for k in ("alone", "pressed")}
    statuses = [s for s, _ in out["pressure"]]
    record("leases_beam_pressure", {"beams": beams, "pressure_statuses": statuses, "after": out["after"][0]})
    assert len(beams["alone"]) == 3 and beams["pressed"] == beams["alone"]
    assert set(statuses) <= {200, 503} and 503 in statuses  # the slots were contended throughout
    assert out["after"][0] == 200
