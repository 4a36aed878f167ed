"""Residency routing in Ray Serve LLM (issue 40): builds per adapter id and time to first token, with and without.

The workload: ``--replicas`` (2) ``LoraExtLLMServer`` replicas behind Ray's OpenAI router, ``--adapters`` (20)
registered adapters and ``--mixes`` (10) mixes of them, ``--requests`` (400) requests drawn Zipf-like
(``--zipf`` 1.1) over those 30 ids, sent ``--concurrency`` (32) at a time through the real ``openai`` client,
streamed (TTFT = the first chunk). Modes (``--modes``), each on a fresh app (fresh replicas, nothing built):

* ``affinity``: ``ServeOptions(residency=True)`` of examples/ray_serve_llm.py, replicas report the plugin's ids
  through Ray's multiplexed loader and ``ResidencyRequestRouter`` routes by residency;
* ``default``: today's routing (``residency=False``): Serve's default router, the plugin's ids unreported;
* ``single``: one replica alone (the reference the outputs must equal).

After each mode, every replica hands back its plugin metrics (``resident_metric.scrape_plugin_metrics`` over
``collective_rpc``: what its ``/metrics`` would show) and ``worker_state``: builds per id are the replicas whose
``vllm_lora_ext_adapter_resident`` gauge holds the id, checked against the replicas' load counters
(``vllm_lora_ext_adapter_loads_total{kind="mix"}`` = mixes held, when nothing was evicted; the CPU cache is sized
to hold all ids). Prints a table and writes JSON (``--out``, default bench/results/residency.json).

    python bench/bench_residency.py                          # 2 GPUs; a tiny model and adapters built here
    python bench/bench_residency.py --two-nodes              # 2 Ray nodes on this host, 1 GPU each (ray start)
    python bench/bench_residency.py --address auto           # an existing cluster
    python bench/bench_residency.py --dry-run                # CPU: workload, both apps built, parsing checked
    python bench/bench_residency.py --modes single --out /tmp/r/single.json   # modes in separate calls: the model
    python bench/bench_residency.py --modes affinity,default --reference /tmp/r/single.json   # and adapters are seeded

The JSON is written after each mode (``"partial": true`` until the last), so a call that runs out of time keeps
the modes it finished.

``--two-nodes`` starts a head and a worker node with ``ray start`` (``CUDA_VISIBLE_DEVICES`` 0 and 1, one GPU
each, separate temp dirs), as a stand-in for two machines; each replica's report then carries its node's GPU, and
``worker_state`` its bytes read. It runs ``ray stop`` at the end (every Ray process on the host): use it on a
machine of its own. The adapters are local folders in ``--workdir`` (one host: both nodes read the same disk);
``--hub N`` serves the first N as ``hf:`` sources from a local Hub server (tests/hubserver.py), each replica
resolving them to the one commit recorded in the JSON (check the replicas' logs for the pinned sha).

``--dry-run`` needs Ray Serve LLM importable with the installed vLLM; it starts a CPU-only local Ray, builds both
apps through Ray's own builder (nothing is deployed), loads the router class as Serve would, and runs the metric
parsing on a gauge written here.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _common import print_table, write_json  # noqa: E402

MODEL_ID = "tiny"
RESIDENT = "vllm_lora_ext_adapter_resident"


# ------------------------------------------------------------------------------------------------ workload


def make_ids(n_adapters: int, n_mixes: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """Adapter names and mixes of two of them (weights written as the plugin's mix names write them)."""
    names = [f"a{i:02d}" for i in range(n_adapters)]
    rng = random.Random(seed)
    pairs: list[tuple[str, str]] = []
    while len(pairs) < n_mixes:
        a, b = rng.sample(names, 2)
        if (a, b) not in pairs:
            pairs.append((a, b))
    return names, [f"{a}=0.7+{b}=0.3" for a, b in pairs]


def zipf_requests(ids: list[str], n: int, s: float, seed: int = 0) -> list[str]:
    """``n`` ids drawn with P(rank k) ∝ 1/k^s, the ranks a seeded shuffle of ``ids``."""
    rng = random.Random(seed)
    order = ids[:]
    rng.shuffle(order)
    weights = [1.0 / (k + 1) ** s for k in range(len(order))]
    return rng.choices(order, weights=weights, k=n)


def held_id(label: str, ids: set[str]) -> str | None:
    """The workload id a gauge label names: a name, or a mix name ``mix-a=0.7+b=0.3-<digest>``."""
    if label in ids:
        return label
    m = re.fullmatch(r"mix-(.+)-[0-9a-f]{24}", label)
    return m.group(1) if m and m.group(1) in ids else None


def parse_replica(text: str, ids: set[str]) -> dict[str, Any]:
    """A replica's plugin metrics: ids held (any level) and its load counters."""
    from prometheus_client.parser import text_string_to_metric_families

    held: dict[str, str] = {}
    loads: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == RESIDENT and s.value:
                wid = held_id(s.labels["adapter_name"], ids)
                if wid is not None:
                    held[wid] = s.labels["level"]
            elif s.name == "vllm_lora_ext_adapter_loads_total" and s.labels.get("outcome") == "ok":
                loads[s.labels["kind"]] = loads.get(s.labels["kind"], 0.0) + s.value
    return {"held": held, "loads_ok": loads}


def summarize(replicas: list[dict[str, Any]], ids: list[str], mixes: list[str]) -> dict[str, Any]:
    builds = {i: sum(i in r["held"] for r in replicas) for i in ids}
    mixes_held = sum(m in r["held"] for r in replicas for m in mixes)
    mix_loads = sum(r["loads_ok"].get("mix", 0.0) for r in replicas)
    requested = [i for i in ids if builds[i]]
    return {"builds_per_id": builds, "mean_builds_per_requested_id": statistics.mean(builds[i] for i in requested)
            if requested else None, "max_builds": max(builds.values(), default=0),
            "gauge_agrees_with_mix_loads": mixes_held == mix_loads, "mixes_held": mixes_held, "mix_loads": mix_loads}


# ------------------------------------------------------------------------------------------------ serving


async def _one(client: Any, model: str, prompt: str, max_tokens: int) -> tuple[float, str]:
    t0 = time.perf_counter()
    ttft, text = None, []
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                             stream=True)
    async for chunk in stream:
        if ttft is None:
            ttft = time.perf_counter() - t0
        text.append(chunk.choices[0].text if chunk.choices else "")
    return (ttft if ttft is not None else time.perf_counter() - t0), "".join(text)


async def drive(base: str, requests: list[str], concurrency: int, max_tokens: int) -> list[Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, wid: str) -> Any:
        async with gate:
            try:
                return await _one(client, f"{MODEL_ID}:{wid}", f"Request {i % 20}: tell me", max_tokens)
            except Exception as err:  # counted, not fatal
                return f"{type(err).__name__}: {str(err)[:300]}"

    return await asyncio.gather(*[one(i, w) for i, w in enumerate(requests)])


def replica_reports(n: int, ids: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each replica's plugin metrics and worker_state, asked until ``n`` distinct replicas answered.

    A call without a multiplexed id goes where Serve's power-of-two choice sends it, which on idle replicas
    can be the same one every time (an H200 run asked 100 times and reached one of two). So the calls go out in
    concurrent bursts (a busy replica loses the choice), then once per workload id as its multiplexed id (the
    router sends it to the replica holding that id)."""
    from ray import serve

    from vllm_lora_ext.integration.plugin import worker_state
    from vllm_lora_ext.resident_metric import scrape_plugin_metrics

    status = serve.status().applications
    app = next(iter(status))
    name = next(d for d in status[app].deployments if d.startswith("LoraExtLLMServer"))
    handle = serve.get_deployment_handle(name, app_name=app)
    scraped: dict[str, Any] = {}
    states: dict[int, Any] = {}

    def ask(handles: list[Any]) -> bool:
        for calls in ([h.collective_rpc.remote(method=scrape_plugin_metrics) for h in handles],
                      [h.collective_rpc.remote(method=worker_state) for h in handles]):
            for call in calls:
                for s in call.result():
                    if "metrics_dir" in s:
                        scraped[str(s["metrics_dir"])] = s
                    else:
                        states[s["pid"]] = s
        return len(scraped) >= n and len(states) >= n

    for _ in range(10):
        if ask([handle] * 8):
            return list(scraped.values()), list(states.values())
    ask([handle.options(multiplexed_model_id=f"{MODEL_ID}:{i}") for i in ids])
    return list(scraped.values()), list(states.values())


def run_mode(mode: str, args: argparse.Namespace, model: str, deploy: str, requests: list[str],
             ids: tuple[list[str], list[str]]) -> dict[str, Any]:
    import ray_serve_llm as recipe
    from ray import serve

    replicas = 1 if mode == "single" else args.replicas
    options = recipe.ServeOptions(replicas=replicas, max_cpu_loras=len(ids[0]) + len(ids[1]) + 2,
                                  residency=mode == "affinity", engine_kwargs=_engine_kwargs(args))
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    t0 = time.perf_counter()
    serve.run(recipe.build_app(model, MODEL_ID, deploy, options), blocking=False)
    started = time.perf_counter() - t0
    try:
        t1 = time.perf_counter()
        got = asyncio.run(drive(f"http://127.0.0.1:{args.port}", requests, args.concurrency, args.max_tokens))
        wall = time.perf_counter() - t1
        scraped, states = replica_reports(replicas, ids[0] + ids[1])
    finally:
        serve.shutdown()
    every = set(ids[0]) | set(ids[1])
    parsed = [parse_replica(str(s["text"]), every) for s in scraped]
    ttfts = sorted(g[0] for g in got if isinstance(g, tuple))
    reads = {st["pid"]: st.get("adapter_reads", {}).get("bytes") for st in states}  # same worker as the scrape
    if len(scraped) < replicas or len(states) < replicas:
        print(f"WARNING: {mode}: {len(scraped)} of {replicas} replicas reported their metrics, {len(states)} their "
              "worker state; builds per id count those only", file=sys.stderr)
    # every build on every replica, mix components included (the gauge shows names and mixes, not the components a
    # mix built): against the single replica's total, what the fleet built more than one engine did
    builds_total = sum(int(st.get("adapter_reads", {}).get("adapters", 0)) for st in states)
    return {"mode": mode, "replicas": replicas, "replicas_reported": len(scraped), "adapter_builds_total": builds_total,
            "serve_start_s": started,
            "wall_s": wall,
            "errors": [g for g in got if isinstance(g, str)][:10], "error_count": sum(isinstance(g, str) for g in got),
            "ttft_p50_s": _pct(ttfts, 50), "ttft_p99_s": _pct(ttfts, 99),
            "outputs": [g[1] if isinstance(g, tuple) else None for g in got],
            "replica_metrics": [{"metrics_dir": s["metrics_dir"], "pid": s["pid"], "gpu": s.get("cuda_visible_devices"),
                                 "bytes_read": reads.get(s["pid"]), **p} for s, p in zip(scraped, parsed)],
            "worker_states": states, **summarize(parsed, sorted(every), ids[1])}


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"enforce_eager": True, "gpu_memory_utilization": args.gpu_memory_utilization, "max_model_len": 256,
            "dtype": "bfloat16", "seed": 0}


def reference_run(path: str, workload: dict[str, Any]) -> dict[str, Any]:
    """The ``single`` run in a JSON this bench wrote (its outputs, its builds), checked to be of the same workload."""
    import json

    earlier = json.loads(Path(path).read_text())
    if earlier.get("workload") != workload:
        raise SystemExit(f"--reference {path}: its workload {earlier.get('workload')} is not this run's {workload}")
    single = earlier.get("runs", {}).get("single", {})
    if single.get("outputs") is None:
        raise SystemExit(f"--reference {path} has no 'single' run")
    return single  # type: ignore[no-any-return]


def build_inputs(workdir: Path, names: list[str], model: str | None, hub: int = 0) -> tuple[str, str, Any]:
    """A tiny dense model (unless ``model`` is given), one PEFT adapter per name, and the deployment config; the
    first ``hub`` adapters are ``hf:`` sources on a local Hub server started here (returned, with its commit)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny import build_dense, build_peft_adapter

    base = Path(model) if model else build_dense(workdir / "model")
    folder = workdir / "adapters"
    for i, name in enumerate(names):
        build_peft_adapter(base, folder / name, seed=100 + i, rank=8, alpha=16, targets=["q_proj", "v_proj", "down_proj"])
    sources = {n: str(folder / n) for n in names}
    server = None
    if hub:
        from hubserver import HubServer

        server = HubServer().start()
        files = {f"{n}/{f}": (folder / n / f).read_bytes() for n in names[:hub]
                 for f in ("adapter_config.json", "adapter_model.safetensors")}
        server.commit_sha = server.repo("acme/residency").commit(files)
        # every replica resolves main to this one commit; build_app passes these to the replicas
        os.environ.update(HF_ENDPOINT=server.url, HF_HUB_CACHE=str(workdir / "hf-cache"), HF_HUB_OFFLINE="0")
        sources.update({n: f"hf:acme/residency:{n}" for n in names[:hub]})
    deploy = workdir / "deploy.yaml"
    deploy.write_text("adapters:\n" + "".join(f"  {n}: {{source: '{src}'}}\n" for n, src in sources.items()))
    return str(base), str(deploy), server


def ray_cli() -> list[str]:
    """The ``ray`` command: beside this Python when installed there, else Ray's CLI module run by this Python
    (the GPU machine's Ray comes unpacked into a folder on ``PYTHONPATH``, with no ``ray`` script)."""
    script = Path(sys.executable).with_name("ray")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()"]


def start_two_nodes(workdir: Path, port: int = 6390, *, own_caches: bool = False) -> str:
    """A head and a worker Ray node on this host, one GPU each; return the head's address.

    With ``own_caches`` each node gets its own Hugging Face cache (``hf-cache-node0``, ``-node1`` under
    ``workdir``), which its replicas inherit: as on two machines, neither reads the other's downloads, and each
    resolves the ``hf:`` sources itself (`node_caches` then lists the commits each holds)."""
    address = f"127.0.0.1:{port}"
    nodes = [["--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={workdir / 'ray'}"],
             [f"--address={address}"]]
    for gpu, extra in enumerate(nodes):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu), RAY_USAGE_STATS_ENABLED="0")
        if own_caches:
            env["HF_HUB_CACHE"] = str(workdir / f"hf-cache-node{gpu}")
        subprocess.run([*ray_cli(), "start", *extra, "--num-gpus=1", "--disable-usage-stats"], env=env, check=True)
    os.environ["RAY_ADDRESS"] = address  # the replicas' engine processes join this cluster too
    if own_caches:
        os.environ.pop("HF_HUB_CACHE", None)  # not in the replicas' runtime_env: each keeps its node's
    return address


def node_caches(workdir: Path, repo: str = "acme/residency") -> dict[str, list[str]]:
    """The commits of ``repo`` in each node's own Hugging Face cache (``start_two_nodes(own_caches=True)``)."""
    folder = "models--" + repo.replace("/", "--")
    return {f"node{i}": sorted(p.name for p in (workdir / f"hf-cache-node{i}" / folder / "snapshots").glob("*"))
            for i in range(2)}


# ------------------------------------------------------------------------------------------------ main


def dry_run(args: argparse.Namespace, requests: list[str], ids: tuple[list[str], list[str]]) -> dict[str, Any]:
    """Everything but serving, on CPU: Ray starts, both apps build, the router loads, metrics parse."""
    checks: dict[str, Any] = {}
    import ray
    import ray_serve_llm as recipe
    from ray.serve.config import RequestRouterConfig

    checks["router_class"] = RequestRouterConfig(
        request_router_class=recipe.RESIDENCY_ROUTER).get_request_router_class().__name__
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # replica_reports sends plugin functions through vLLM's collective_rpc, which pickles only with this set; the
    # Ray nodes started below (and their replicas) inherit it
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            deploy = Path(tmp) / "deploy.yaml"
            deploy.write_text("adapters: {}\n")
            for mode in ("affinity", "default"):
                options = recipe.ServeOptions(replicas=args.replicas, residency=mode == "affinity")
                try:
                    recipe.build_app("/m", MODEL_ID, str(deploy), options)
                    checks[f"app_{mode}"] = "built"
                except Exception as err:  # e.g. Ray's LLM config not matching the installed vLLM
                    checks[f"app_{mode}"] = f"{type(err).__name__}: {str(err)[:300]}"
    finally:
        ray.shutdown()
    from vllm_lora_ext import metrics
    from vllm_lora_ext.resident_metric import clear_resident, scrape_plugin_metrics, write_resident

    metrics.setup()
    write_resident({ids[0][0]: "gpu", f"mix-{ids[1][0]}-{'0' * 24}": "cpu"}, max_series=8)
    parsed = parse_replica(str(scrape_plugin_metrics()["text"]), set(ids[0]) | set(ids[1]))
    clear_resident()
    checks["metrics_parse"] = parsed["held"] == {ids[0][0]: "gpu", ids[1][0]: "cpu"}
    return checks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--adapters", type=int, default=20)
    ap.add_argument("--mixes", type=int, default=10)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--modes", default="affinity,default,single")
    ap.add_argument("--model", default=None, help="base model folder (default: a tiny dense model built here)")
    ap.add_argument("--address", default=None, help="an existing Ray cluster (default: a local one, 1 GPU/replica)")
    ap.add_argument("--two-nodes", action="store_true", help="start 2 Ray nodes on this host, 1 GPU each")
    ap.add_argument("--hub", type=int, default=0, help="serve the first N adapters as hf: sources from a local Hub")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--dry-run", action="store_true", help="CPU: check the plumbing, serve nothing")
    ap.add_argument("--reference", default=None,
                    help="a JSON this bench wrote with the same workload whose 'single' run is the reference outputs "
                         "(to run the modes in separate calls: --modes single, then --modes affinity --reference ...)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    names, mixes = make_ids(args.adapters, args.mixes)
    requests = zipf_requests(names + mixes, args.requests, args.zipf)
    payload: dict[str, Any] = {"workload": {
        "replicas": args.replicas, "adapters": len(names), "mixes": len(mixes), "requests": len(requests),
        "zipf_s": args.zipf, "concurrency": args.concurrency, "distinct_requested": len(set(requests)),
        "top_id_share": max(requests.count(i) for i in set(requests)) / len(requests)}}
    if args.dry_run:
        payload["dry_run"] = dry_run(args, requests, (names, mixes))
        print_table([[k, v] for k, v in payload["dry_run"].items()], ["check", "result"])
        write_json("residency_dry_run", payload, args.out)
        return

    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # replica_reports sends plugin functions through vLLM's collective_rpc, which pickles only with this set; the
    # Ray nodes started below (and their replicas) inherit it
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_residency_"))
    model, deploy, hub = build_inputs(workdir, names, args.model, args.hub)
    if hub is not None:
        payload["hub_commit"] = hub.commit_sha
    address = start_two_nodes(workdir, own_caches=hub is not None) if args.two_nodes else args.address
    if address:
        ray.init(address=address)
    else:
        ray.init(num_gpus=args.replicas, include_dashboard=False, log_to_driver=False)
    runs = {}
    try:
        payload["nodes"] = [{"node_id": n["NodeID"], "gpus": n["Resources"].get("GPU")} for n in ray.nodes()
                            if n.get("Alive")]
        for mode in args.modes.split(","):
            runs[mode] = run_mode(mode, args, model, deploy, requests, (names, mixes))
            write_json("residency", {**payload, "runs": runs, "partial": True}, args.out)  # kept if a later mode dies
    finally:
        ray.shutdown()
        if hub is not None:
            hub.stop()
        if args.two_nodes:
            subprocess.run([*ray_cli(), "stop", "--force"], check=False)
    if args.two_nodes and hub is not None:  # each node resolved the hf: sources itself, to the one pinned commit
        payload["node_caches"] = node_caches(workdir)
    single = runs.get("single")
    if single is None and args.reference:
        single = reference_run(args.reference, payload["workload"])
        payload["reference"] = args.reference
    ref = (single or {}).get("outputs")
    single_builds = (single or {}).get("adapter_builds_total")
    rows = []
    for mode, r in runs.items():
        equal = None if ref is None else sum(a == b for a, b in zip(r["outputs"], ref) if a is not None)
        r["outputs_equal_to_single"] = equal
        r["builds_vs_single"] = r["adapter_builds_total"] / single_builds if single_builds else None
        rows.append([mode, r["replicas"], r["mean_builds_per_requested_id"], r["max_builds"], r["adapter_builds_total"],
                     r["ttft_p50_s"], r["ttft_p99_s"], r["error_count"], r["gauge_agrees_with_mix_loads"],
                     "-" if equal is None else f"{equal}/{len(requests)}"])
    payload["runs"] = runs
    print_table(rows, ["mode", "replicas", "builds/id", "max", "builds (all)", "TTFT p50 s", "TTFT p99 s", "errors",
                       "gauge=loads", "outputs = single"])
    write_json("residency", payload, args.out)


if __name__ == "__main__":
    main()
