"""`vllm serve` in front of hostile and heavy clients, through the real `openai` client (issue: hardening).

One server, a tiny dense model, four adapters from a deployment config, ``--max-loras 2`` and a mix
registry bounded at 4 (``VLLM_LORA_EXT_MAX_MIXES``). Then:

1. every (mix, prompt) pair of 12 distinct mixes (3x --max-loras, 3x the registry bound) is run alone;
2. 1,200 good requests over those pairs plus 120 malformed ones are sent at once: every malformed request
   gets a 4xx, and every good output equals its run alone, except where the alone run's top-2 logprobs tie
   exactly at the first differing position (each such case is logged);
3. 10,000 distinct mixes are served; the API server's RSS after them stays within 10% of its RSS after 100.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from serving import dense_deployment, http_module, vllm_serve
from tiny import prompts

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

N_TOKENS = 8
ADAPTERS = ("a", "b", "c", "d")


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _mixes() -> list[tuple[list[str], list[float]]]:
    pairs = [(x, y) for i, x in enumerate(ADAPTERS) for y in ADAPTERS[i + 1:]]
    return [([x, y], [0.5, 0.5]) for x, y in pairs] + [([x, y], [0.9, -0.4]) for x, y in pairs]


def _tokens(choice: Any) -> tuple[list[int], list[dict[str, float]]]:
    lp = choice.logprobs
    return [int(t.split(":")[1]) for t in lp.tokens], [dict(d) for d in lp.top_logprobs]


@pytest.fixture(scope="module")
def server(gpu_workdir: Path) -> Any:
    model, roots, deploy = dense_deployment(gpu_workdir, "hostile", dict.fromkeys(ADAPTERS, 1.0),
                                            seed=10, targets=["q_proj", "v_proj", "down_proj"])
    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="1", VLLM_LORA_EXT_CONFIG=str(deploy),
               VLLM_LORA_EXT_MAX_MIXES="4", VLLM_LORA_EXT_MIX_WAIT_S="600", VLLM_LORA_EXT_ALLOWED_ROOTS=str(roots))
    args = ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "2", "--max-cpu-loras", "4", "--enforce-eager",
            "--gpu-memory-utilization", "0.3", "--max-model-len", "256", "--max-num-seqs", "256", "--dtype", "bfloat16",
            "--seed", "0"]
    with vllm_serve(model, args, env=env, log_path=gpu_workdir / "hostile-serve.log",
                    keep_log_as="hostile-serve.log") as srv:
        yield {**srv, "model": str(model), "roots": roots}


def _client(base: str) -> Any:
    import openai

    limits = http_module().Limits(max_connections=2000, max_keepalive_connections=2000)
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=900,
                              http_client=openai.DefaultAsyncHttpxClient(limits=limits, timeout=900))


async def _complete(client: Any, model: str, prompt: list[int], mix: tuple[list[str], list[float]],
                    max_tokens: int = N_TOKENS) -> Any:
    return await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, logprobs=2,
        extra_body={"adapters": mix[0], "adapter_weights": mix[1], "ignore_eos": True,
                    "return_tokens_as_token_ids": True})


def _malformed(model: str, p: list[int]) -> list[tuple[str, dict[str, Any], int]]:
    """(route, body, expected status) for requests no server may accept."""
    good = {"prompt": p, "max_tokens": 2}
    return [
        ("completions", {**good, "model": model, "adapters": ["a", "b"], "adapter_weights": [1e308, 0.5]}, 400),
        ("completions", {**good, "model": model, "adapters": ["a", "b"], "adapter_weights": ["x", 0.5]}, 400),
        ("completions", {**good, "model": model, "adapters": ["a", "nope"]}, 400),
        ("completions", {**good, "model": model, "adapters": ["a"] * 17}, 400),
        ("completions", {**good, "model": model, "adapter_weights": [0.5]}, 400),
        ("completions", {**good, "model": "a=nan+b"}, 400),
        ("completions", {**good, "model": "a=0.5+" * 1000 + "b"}, 400),
        ("completions", {**good, "model": model, "adapters": "a"}, 400),
        ("load_lora_adapter", {"lora_name": "mix-a=0.5-0000", "lora_path": "/tmp"}, 400),
        ("load_lora_adapter", {"lora_name": "x", "lora_path": 'mix:{"v":1,"adapters":[["a","/etc",0.5]]}'}, 400),
        ("load_lora_adapter", {"lora_name": "y", "lora_path": "/etc"}, 403),
        ("load_lora_adapter", {"lora_name": "z", "lora_path": "hf:acme/x:../y"}, 400),
    ]


async def _post(client: Any, base: str, route: str, body: dict[str, Any]) -> int:
    r = await client.post(f"{base}/v1/{route}", content=json.dumps(body).encode(),
                          headers={"Content-Type": "application/json"})
    return int(r.status_code)


def test_many_concurrent_mixes_over_a_bounded_registry_equal_each_alone(server: Any, record: Any) -> None:
    base, model = server["base"], server["model"]
    mixes = _mixes()
    ps = prompts(n=4, seed=11)
    pairs = [(m, p) for m in range(len(mixes)) for p in range(len(ps))]

    async def run() -> dict[str, Any]:
        client = _client(base)
        alone: dict[tuple[int, int], Any] = {}
        for m, p in pairs:  # one request in flight at a time
            r = await _complete(client, model, ps[p], mixes[m])
            alone[(m, p)] = _tokens(r.choices[0])
        good = [pairs[i % len(pairs)] for i in range(1200)]
        bad = [_malformed(model, ps[0])[i % 12] for i in range(120)]
        http = http_module()
        raw = http.AsyncClient(limits=http.Limits(max_connections=500), timeout=900)
        tasks: list[Any] = []
        for i, (m, p) in enumerate(good):
            tasks.append(_complete(client, model, ps[p], mixes[m]))
            if i % 10 == 0:
                route, body, _ = bad[i // 10]
                tasks.append(_post(raw, base, route, body))
        t0 = time.perf_counter()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        wall = time.perf_counter() - t0
        await raw.aclose()
        return {"alone": alone, "good": good, "bad": bad, "results": results, "wall": wall, "client": client}

    out = asyncio.run(run())
    good_results, bad_status = [], []
    for r in out["results"]:
        (bad_status if isinstance(r, int) else good_results).append(r)
    errors = [repr(r)[:300] for r in good_results if isinstance(r, BaseException)]
    assert not errors, errors[:5]
    ties, mismatches = [], []
    for (m, p), r in zip(out["good"], good_results):
        got, _ = _tokens(r.choices[0])
        want, top = out["alone"][(m, p)]
        if got != want:
            i = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
            vals = sorted(top[i].values(), reverse=True)
            entry = {"mix": m, "prompt": p, "position": i, "alone": want, "got": got, "alone_top2": top[i]}
            (ties if len(vals) >= 2 and vals[0] == vals[1] else mismatches).append(entry)
    expected_bad = [s for _, _, s in out["bad"]]
    record("hostile_concurrent", {"good_requests": len(good_results), "malformed_requests": len(bad_status),
                                  "distinct_mixes": len(mixes), "max_loras": 2, "registry_bound": 4,
                                  "wall_s": out["wall"], "exact_top2_ties": ties, "mismatches": mismatches[:20],
                                  "malformed_statuses": sorted(set(bad_status)),
                                  "malformed_as_expected": bad_status == expected_bad})
    assert len(good_results) == 1200 and len(bad_status) == 120
    assert bad_status == expected_bad
    assert not mismatches, mismatches[:3]
    assert len({tuple(v[0]) for v in out["alone"].values()}) > len(ps)  # mixes really differ


def test_api_server_memory_stays_flat_over_ten_thousand_distinct_mixes(server: Any, record: Any) -> None:
    base, model, pid = server["base"], server["model"], server["proc"].pid
    p = prompts(n=1, seed=12)[0]

    async def run() -> dict[str, Any]:
        client = _client(base)
        sem = asyncio.Semaphore(32)
        rss: dict[int, int] = {}
        done = 0

        async def one(i: int) -> None:
            nonlocal done
            async with sem:
                await _complete(client, model, p, (["a", "b"], [0.5, round(-1 + 2 * i / 10_000, 6)]), max_tokens=1)
            done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(100)))
        rss[100] = _rss(pid)
        await asyncio.gather(*(one(i) for i in range(100, 10_000)))
        rss[10_000] = _rss(pid)
        return {"rss": rss, "wall_s": time.perf_counter() - t0, "done": done}

    out = asyncio.run(run())
    growth = out["rss"][10_000] / out["rss"][100] - 1
    record("hostile_rss", {"rss_after_100": out["rss"][100], "rss_after_10000": out["rss"][10_000],
                           "growth": growth, "requests": out["done"], "wall_s": out["wall_s"]})
    assert out["done"] == 10_000
    assert abs(growth) <= 0.10
