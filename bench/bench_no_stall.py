"""Benchmark: does bringing a new adapter into service stall the requests already running? Stock vs plugin.

One `vllm serve` per mode on a Qwen3-30B-A3B-shaped model (``load_format=dummy``, vocab cut to the
tiny test tokenizer's 400 tokens; the 48 x 128-expert MoE blocks the adapters target are full size).
Adapter A is served from start-up. Each case:

1. 32 streaming requests on A decode ``--tokens`` tokens each (greedy, ``ignore_eos``);
2. ``--arrive`` seconds in, a new adapter B arrives: ``POST /v1/load_lora_adapter`` then a streaming
   request on B (for a mix: a request naming four registered adapters with weights, no load call);
3. every token's arrival time is recorded.

Reported per case: the in-flight requests' largest and p99 gap between tokens in the window from B's
arrival to B's first token (+0.25 s), B's time to first token from its arrival, the in-flight tokens/s
in that window against the same window of a run where nothing arrives, and whether every in-flight
output equals that run's output (same prompts; outputs with B preloaded before they start).

Cases: ``2d`` (the 1.7 GB per-expert adapter), ``3d`` (the fused one; stock vLLM cannot be told a
served adapter is 3D, so it runs for the plugin only), ``mix`` (a new mix of four registered 3D
adapters, plugin only), ``mix_cached`` (after ``mix``: another new mix of the same four, whose builds the
worker has cached), ``loaded`` (B is adapter A itself, already in a slot: the first-token reference).
``--modes stock,plugin,thread,sync``: stock = the plugin installed but disabled; thread = background builds in a
worker thread instead of the build process (``VLLM_LORA_EXT_BUILD_PROCESS=0``); sync = the plugin loading in the
engine step (``VLLM_LORA_EXT_PREBUILD=0``), whose time to first token is the plugin's own load time, which
background loading is measured against; plugin_old = the plugin imported from ``--old-src`` (``git archive <rev>
src/vllm_lora_ext``, its ``src``) in the server and its build process: an earlier version beside this one in the same
run, on the same machine (its JSON carries both sides' medians and their ratio). ``--graphs``: full CUDA graphs (no
torch.compile) instead of eager steps.
The prefix cache is off and the server warms up twice, so that no Triton kernel compiles inside a measured run; B
arrives ``--arrive`` seconds (default 4) into the in-flight requests.

Usage: python bench/bench_no_stall.py [--cases 2d,3d,mix] [--modes stock,plugin,sync,plugin_old] [--old-src DIR]
    [--graphs] [--reps N] [--out FILE]
(the round-4 numbers: ``--graphs`` with the defaults, plugin in one call and ``--modes sync,stock`` in the next)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
from _common import print_table, write_json  # noqa: E402
from bench_moe_load import QWEN3_30B_A3B, make_adapter  # noqa: E402

N_INFLIGHT = 32


def _http() -> Any:
    try:  # the openai client on the GPU machine is built on httpx2
        import httpx2 as http
    except ImportError:
        import httpx as http
    return http


def build(work: Path, cases: list[str]) -> dict[str, Path]:
    from tiny import build_tokenizer

    model = work / "qwen3-30b-a3b"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, "vocab_size": 400, "bos_token_id": 1,
                                                   "eos_token_id": 2}))
    build_tokenizer(model)
    paths = {"model": model}
    for name, form in [("A", "2d"), ("B2d", "2d"), ("B3d", "3d")] + [(f"C{i}", "3d") for i in range(4)]:
        if name == "B3d" and "3d" not in cases or name.startswith("C") and not {"mix", "mix_cached"} & set(cases):
            continue
        folder = work / "adapters" / name
        if not (folder / "adapter_model.safetensors").exists():
            make_adapter(folder, 48, form)
        paths[name] = folder
    return paths


async def _stream(client: Any, base: str, body: dict[str, Any], times: list[float], texts: list[str]) -> None:
    async with client.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:500]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text = chunk["choices"][0].get("text", "")
            if text or chunk["choices"][0].get("finish_reason") is None:
                times.append(time.perf_counter())
                texts.append(text)


async def run_case(base: str, model: str, case: str | None, paths: dict[str, Path], tokens: int,
                   arrive: float, rep: int = 0) -> dict[str, Any]:
    http = _http()
    limits = http.Limits(max_connections=100, max_keepalive_connections=100)
    async with http.AsyncClient(timeout=600, limits=limits) as client:
        prompts = [[(7 * i + j) % 390 + 5 for j in range(16)] for i in range(N_INFLIGHT)]
        times: list[list[float]] = [[] for _ in prompts]
        texts: list[list[str]] = [[] for _ in prompts]
        t0 = time.perf_counter()
        wall0 = time.time()
        inflight = [asyncio.create_task(_stream(client, base, {"model": "A", "prompt": p, "max_tokens": tokens,
                                                               "temperature": 0.0, "ignore_eos": True}, times[i],
                                                texts[i])) for i, p in enumerate(prompts)]
        out: dict[str, Any] = {"case": case, "t0_wall": wall0}
        stamp = time.strftime("%H:%M:%S", time.localtime(wall0)) + f"{wall0 % 1:.3f}"[1:]
        print(f"case {case}: started at {stamp} (the server log's clock)", flush=True)
        if case is not None:
            await asyncio.sleep(arrive)
            b_times: list[float] = []
            t_arrive = time.perf_counter()
            body: dict[str, Any] = {"prompt": prompts[0], "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
            if case in ("mix", "mix_cached"):  # mix_cached: a second new mix of the same (now cached) adapters
                weights = [0.4, 0.3, 0.2, 0.1] if case == "mix" else [0.1, 0.2, 0.3, 0.4]
                body.update(model=model, adapters=["C0", "C1", "C2", "C3"], adapter_weights=weights)
            elif case == "loaded":  # the reference: a request on an adapter already in a slot
                body.update(model="A")
            else:
                name = f"B{case}" + (f"-r{rep}" if rep else "")  # a later rep: the same files, a new adapter
                out["b_name"] = name
                r = await client.post(f"{base}/v1/load_lora_adapter",
                                      json={"lora_name": name, "lora_path": str(paths[f"B{case}"])})
                out["load_status"] = r.status_code
                out["load_seconds"] = time.perf_counter() - t_arrive
                body.update(model=name)
            b_texts: list[str] = []
            await _stream(client, base, body, b_times, b_texts)
            out["b_text"] = "".join(b_texts)
            out["b_ttft"] = b_times[0] - t_arrive
            out["t_arrive"] = t_arrive - t0
            out["t_b_first"] = b_times[0] - t0
        await asyncio.gather(*inflight)
    out["times"] = [[t - t0 for t in ts] for ts in times]
    out["texts"] = ["".join(tx) for tx in texts]
    return out


_STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"


def b_phases(log: str, name: str, t_arrive_wall: float) -> dict[str, Any]:
    """Where B's time to first token went, from the plugin's lines in the server log (issue 39 item 4): the build
    process's build and hand-over ("built adapter 'B2d' in X s, handed over in Y s", with the job's time in the pipe
    and queued), the worker's wait for that answer ("the build process answered X s after the job was sent"), its
    load ("loaded adapter 'B2d' ... X s (describing ..., building ..., wrapping ...)") and GPU staging ("staged N
    MiB ... in T s"), each with its log time in seconds after B arrived."""
    import datetime
    import re

    def after(stamp: str) -> float:
        wall = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        return round(wall - t_arrive_wall, 3)

    out: dict[str, Any] = {}
    for line in log.splitlines():
        m = re.search(_STAMP + r".*loaded adapter '" + re.escape(name) + r"' .*?, ([\d.]+) s \((.*)\)$", line)
        if m and "build" not in out:
            out["build"] = {"done_after_arrival_s": after(m.group(1)), "seconds": float(m.group(2)),
                            "phases": m.group(3)}
        m = re.search(_STAMP + r".*built adapter '" + re.escape(name) + r"' in ([\d.]+) s, handed over in ([\d.]+) s "
                      r"\(([\d.]+) MiB; (?:in the pipe ([\d.]+) s, )?queued ([\d.]+) s", line)
        if m and "build_process" not in out:
            out["build_process"] = {"done_after_arrival_s": after(m.group(1)), "build_s": float(m.group(2)),
                                    "hand_over_s": float(m.group(3)), "mib": float(m.group(4)),
                                    "queued_s": float(m.group(6))}
            if m.group(5) is not None:  # the job's time from the worker's send to the build process
                out["build_process"]["in_pipe_s"] = float(m.group(5))
        m = re.search(_STAMP + r".*adapter '" + re.escape(name) + r"': the build process answered ([\d.]+) s after the "
                      r"job was sent[^;]*; mapped in ([\d.]+) s", line)
        if m and "answer" not in out:  # the worker's wait, from its send to the answer: pipe, build, hand-over, reply
            out["answer"] = {"done_after_arrival_s": after(m.group(1)), "after_send_s": float(m.group(2)),
                             "mapped_s": float(m.group(3))}
        m = re.search(_STAMP + r".*staged ([\d.]+) MiB on \S+ in ([\d.]+) s", line)
        if m and "build" in out and "staging" not in out:
            out["staging"] = {"done_after_arrival_s": after(m.group(1)), "mib": float(m.group(2)),
                              "seconds": float(m.group(3))}
        _engine_phases(line, name, after, out)
    return out


def _engine_phases(line: str, name: str, after: Any, out: dict[str, Any]) -> None:
    """After staging: vLLM's merge on the build's thread ("merged ahead in X s"), the slot writes planned there ("N
    slot writes planned in X s"), the server's last probe ("built in the background, answered X s after the first
    probe (N probes)"), the engine taking the model ("taken by the engine"), its registration and slot copy in the
    engine thread ("registered and copied into its slot in X s, unstaged in Y s"), and the load route's answer
    ("registered by the engine X s after its build was answered")."""
    import re

    q = re.escape(name)
    patterns = {
        "probed": (r".*adapter '" + q + r"': built in the background, answered ([\d.]+) s after the first probe "
                   r"\((\d+) probes\)", ("after_first_probe_s", "probes")),
        "merged": (r".*adapter '" + q + r"': merged ahead in ([\d.]+) s", ("merge_s",)),
        "planned": (r".*adapter '" + q + r"': (\d+) slot writes planned in ([\d.]+) s", ("slot_writes", "plan_s")),
        "taken": (r".*adapter '" + q + r"' \(id \d+\): built in the background, taken by the engine", ()),
        "slot_copy": (r".*adapter '" + q + r"' \(id \d+\): registered and copied into its slot in ([\d.]+) s, "
                      r"unstaged in ([\d.]+) s \((\d+) bytes", ("register_s", "unstage_s", "copied_back_bytes")),
        "registered": (r".*adapter '" + q + r"': registered by the engine ([\d.]+) s after its build was answered",
                       ("after_build_answer_s",)),
    }
    for phase, (pattern, fields) in patterns.items():
        m = re.search(_STAMP + pattern, line)
        if m and phase not in out:
            out[phase] = {"done_after_arrival_s": after(m.group(1)),
                          **{f: float(m.group(i + 2)) for i, f in enumerate(fields)}}


def window_stats(run: dict[str, Any], start: float, end: float) -> dict[str, float]:
    gaps, count = [], 0
    for ts in run["times"]:
        for a, b in zip(ts, ts[1:]):
            if start <= b <= end:
                gaps.append(b - a)
        count += sum(1 for t in ts if start <= t <= end)
    gaps.sort()
    return {"max_gap": gaps[-1] if gaps else float("nan"),
            "p99_gap": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else float("nan"),
            "p50_gap": gaps[len(gaps) // 2] if gaps else float("nan"), "over_150ms": sum(g > 0.15 for g in gaps),
            "tok_per_s": count / max(end - start, 1e-9)}


def serve_mode(mode: str, paths: dict[str, Path], cases: list[str], args: argparse.Namespace) -> dict[str, Any]:
    from serving import vllm_serve

    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="1", VLLM_LORA_EXT_DISABLE="1" if mode == "stock" else "0",
               VLLM_LORA_EXT_PREBUILD="0" if mode == "sync" else "1",
               VLLM_LORA_EXT_BUILD_PROCESS="0" if mode == "thread" else "1")
    if mode == "plugin_old":  # the server, its engine and its build process import the earlier package first
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.old_src, env.get("PYTHONPATH")) if p)
    modules = ["A=" + str(paths["A"])] + ([f"C{i}={paths[f'C{i}']}" for i in range(4)] if mode != "stock" and
                                           {"mix", "mix_cached"} & set(cases) else [])
    # Eager steps of this model take up to ~0.19 s with nothing arriving; --graphs captures full CUDA graphs
    # (no torch.compile) for every batch up to 64 tokens, decode and mixed prefill+decode alike (FlashAttention 3).
    graphs = ["--compilation-config", json.dumps({"mode": 0, "cudagraph_mode": "FULL",
                                                  "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 40, 48, 64]})]
    serve_args = ["--enable-lora", "--max-lora-rank", "64", "--max-loras", "3", "--max-cpu-loras", "8",
                  "--load-format", "dummy", *(graphs if args.graphs else ["--enforce-eager"]),
                  "--max-model-len", "1024", "--dtype", "bfloat16",
                  "--gpu-memory-utilization", "0.85", "--max-num-seqs", "64", "--seed", "0",
                  # every run then has the same batch shapes, so the warm-up compiles every Triton kernel a run
                  # needs (with the prefix cache, a repeated run prefilled 1 token a prompt: new shapes, and
                  # 2-3 s of Triton JIT in the step at its start, seen with VLLM_LORA_EXT_STALL_TRACE_S)
                  "--no-enable-prefix-caching",
                  "--lora-modules", *modules]
    runs: dict[str, Any] = {}
    with vllm_serve(paths["model"], serve_args, env=env, log_path=Path(args.workdir) / f"serve-{mode}.log",
                    keep_log_as=f"serve-{mode}.log", timeout=900) as srv:
        base, model = srv["base"], str(paths["model"])
        for _ in range(2):  # warm-up
            asyncio.run(run_case(base, model, None, paths, 8, args.arrive))
        time.sleep(args.settle)  # a server that has been up a while: the build process (15-20 s to start) is ready
        runs["none"] = asyncio.run(run_case(base, model, None, paths, args.tokens, args.arrive))
        for rep in range(args.reps):  # reps after the first: 2D, 3D and loaded only (a mix is new only once)
            for case in cases:
                if (mode == "stock" and case not in ("2d", "loaded")) or (rep and case in ("mix", "mix_cached")):
                    continue
                runs[case + (f"#{rep}" if rep else "")] = asyncio.run(run_case(base, model, case, paths, args.tokens,
                                                                                args.arrive, rep))
        runs["none_again"] = asyncio.run(run_case(base, model, None, paths, args.tokens, args.arrive))
    log = (Path(args.workdir) / f"serve-{mode}.log").read_text(errors="replace")
    for run in runs.values():
        if "b_name" in run and mode != "stock":
            run["b_phases"] = b_phases(log, run["b_name"], run["t0_wall"] + run["t_arrive"])
    return runs


def _medians(summary: dict[str, Any], cases: list[str], reps: int) -> None:
    """With ``--reps`` > 1: each mode and case's median over its reps (``<mode>/<case>/median``), printed."""
    if reps < 2:
        return
    for key in [k for k in list(summary) if "#" not in k and k.split("/")[-1] in cases]:
        rows = [summary[k] for k in summary if k == key or k.startswith(key + "#")]
        if len(rows) > 1:
            med = {f: statistics.median(r[f] for r in rows) for f in _COMPARED}
            summary[key + "/median"] = {**med, "reps": len(rows)}
            print(f"{key}, median of {len(rows)}: max gap {med['max_gap_s']:.4f} s, B TTFT {med['b_ttft_s']:.4f} s, "
                  f"tok/s {med['throughput_ratio']:.3f}x")


_COMPARED = ("max_gap_s", "b_ttft_s", "throughput_ratio")  # each case's figures that medians and ratios take


def _ratios(ours: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    """``ours``' compared figures over ``base``'s (a figure that is 0 in ``base`` is left out)."""
    return {f: ours[f] / base[f] for f in _COMPARED if base[f]}


def _against_old(summary: dict[str, Any], cases: list[str]) -> None:
    """This version (``plugin``) against the earlier one (``plugin_old``), case by case: each side's median over its
    reps (its one run without ``--reps``), and this version's over the earlier one's (``plugin_vs_old/<case>``)."""
    for case in cases:
        sides = {m: summary.get(f"{m}/{case}/median") or summary.get(f"{m}/{case}") for m in ("plugin", "plugin_old")}
        if not all(sides.values()):
            continue
        ratios = _ratios(sides["plugin"], sides["plugin_old"])
        summary[f"plugin_vs_old/{case}"] = {"plugin": {f: sides["plugin"][f] for f in _COMPARED},
                                            "plugin_old": {f: sides["plugin_old"][f] for f in _COMPARED},
                                            "ratio": ratios}
        print(f"{case}, plugin / plugin_old: " + ", ".join(f"{k} {v:.3g}x" for k, v in ratios.items()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="2d,3d,mix,mix_cached,loaded")
    ap.add_argument("--modes", default="stock,plugin")
    ap.add_argument("--tokens", type=int, default=700)
    ap.add_argument("--arrive", type=float, default=4.0,
                    help="seconds into the in-flight requests B arrives (after their start-up steps)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--graphs", action="store_true", help="full CUDA graphs instead of --enforce-eager")
    ap.add_argument("--settle", type=float, default=20.0, help="seconds between the warm-up and the measured runs")
    ap.add_argument("--reps", type=int, default=1, help="runs of each 2D, 3D and loaded case in one server (a later "
                                                         "rep loads the same files as a new adapter); medians printed")
    ap.add_argument("--old-src", default=None,
                    help="the package folder (git archive <rev> src/vllm_lora_ext, its src/) that mode plugin_old "
                         "imports first: an earlier version beside this one in the same run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    unknown = set(args.modes.split(",")) - {"stock", "plugin", "thread", "sync", "plugin_old"}
    if unknown:
        ap.error(f"--modes: {sorted(unknown)} are not modes; give stock, plugin, thread, sync or plugin_old")
    if "plugin_old" in args.modes.split(",") and not args.old_src:
        ap.error("--modes plugin_old needs --old-src")
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="bench-no-stall-")
    cases = args.cases.split(",")
    paths = build(Path(args.workdir), cases)
    results: dict[str, Any] = {}
    for mode in args.modes.split(","):
        results[mode] = serve_mode(mode, paths, cases, args)
        # survives a later timeout: beside --out (a GPU call packs it), else in the workdir
        partial = Path(args.out).with_suffix(f".partial-{mode}.json") if args.out else Path(args.workdir,
                                                                                           f"partial-{mode}.json")
        partial.write_text(json.dumps(results[mode]))
    rows, summary = [], {}
    for mode, runs in results.items():
        none = runs["none"]
        for case in [k for k in runs if k.split("#")[0] in cases]:
            run = runs[case]
            start, end = run["t_arrive"], run["t_b_first"] + 0.25
            with_b = window_stats(run, start, end)
            # the no-B reference: the faster of the run before the cases and the one after them (a stall in
            # either, e.g. Triton compiling a kernel, would otherwise flatter the ratio)
            without = max((window_stats(r, start, end) for r in (none, runs["none_again"])),
                          key=lambda w: w["tok_per_s"] if w["tok_per_s"] == w["tok_per_s"] else -1.0)
            same = sum(a == b for a, b in zip(run["texts"], none["texts"]))
            control = sum(a == b for a, b in zip(runs["none_again"]["texts"], none["texts"]))
            row = {"max_gap_s": with_b["max_gap"], "p99_gap_s": with_b["p99_gap"], "p50_gap_s": with_b["p50_gap"],
                   "gaps_over_150ms": with_b["over_150ms"], "b_ttft_s": run["b_ttft"],
                   "load_seconds": run.get("load_seconds"), "throughput_ratio": with_b["tok_per_s"] /
                   max(without["tok_per_s"], 1e-9), "outputs_equal": same, "control_equal": control,
                   "baseline_max_gap_s": without["max_gap"], "baseline_p50_gap_s": without["p50_gap"]}
            summary[f"{mode}/{case}"] = row
            rows.append([mode, case, row["max_gap_s"], row["p99_gap_s"], row["baseline_max_gap_s"], row["b_ttft_s"],
                         row["throughput_ratio"], f"{same}/{N_INFLIGHT}", f"{control}/{N_INFLIGHT}"])
    _medians(summary, cases, args.reps)
    if "stock" in results and "plugin" in results and "2d" in results["stock"] and "2d" in results["plugin"]:
        summary["b2d_output_equals_stock"] = results["plugin"]["2d"]["b_text"] == results["stock"]["2d"]["b_text"]
        print("B (2D) output, plugin (built in the background) == stock (built in the step):",
              summary["b2d_output_equals_stock"])
    for mode in ("plugin", "thread", "sync"):  # against stock in the same run (stock: the 2D case only)
        if f"{mode}/2d" in summary and "stock/2d" in summary:
            ours, stock = summary[f"{mode}/2d"], summary["stock/2d"]
            ratios = _ratios(ours, stock)
            ours["vs_stock"] = ratios
            print(f"2D, {mode} / stock: " + ", ".join(f"{k} {v:.3g}x" for k, v in ratios.items()))
    _against_old(summary, cases)
    if "plugin" in results and "plugin_old" in results:  # B's own greedy text: the same adapter, built two ways
        summary["b_text_equals_old"] = {k: run["b_text"] == results["plugin_old"][k].get("b_text")
                                        for k, run in results["plugin"].items()
                                        if isinstance(run, dict) and "b_text" in run and k in results["plugin_old"]}
        print("B's output, plugin == plugin_old:", summary["b_text_equals_old"])
    for mode in ("plugin", "thread"):
        for case in ("2d", "3d", "mix", "mix_cached"):
            if f"{mode}/{case}" in summary and f"sync/{case}" in summary:
                extra = summary[f"{mode}/{case}"]["b_ttft_s"] - summary[f"sync/{case}"]["b_ttft_s"]
                summary[f"{mode}/{case}"]["b_ttft_over_sync_s"] = extra
                print(f"B ({case}, {mode}) first token, background minus in-step load: {extra:+.3f} s")
    for mode in results:  # a new mix of cached adapters against a request on an adapter already in a slot
        if f"{mode}/mix_cached" in summary and f"{mode}/loaded" in summary:
            extra = summary[f"{mode}/mix_cached"]["b_ttft_s"] - summary[f"{mode}/loaded"]["b_ttft_s"]
            summary[f"{mode}/mix_cached"]["b_ttft_over_loaded_s"] = extra
            print(f"new mix of cached adapters ({mode}) first token, minus a loaded adapter's: {extra:+.3f} s")
    print_table(rows, ["mode", "case", "max gap s", "p99 gap s", "no-B max gap s", "B TTFT s", "tok/s vs no B",
                       "outputs = preloaded", "control"])
    payload = {"summary": summary, "runs": {m: {c: {k: v for k, v in r.items() if k != "times"} for c, r in runs.items()}
                                            for m, runs in results.items()}, "inflight": N_INFLIGHT,
               "tokens": args.tokens, "arrive_s": args.arrive, "graphs": args.graphs,
               "old_src": args.old_src,
               "note": f"{args.reps} run(s) per 2D, 3D and loaded case and mode (case#k: rep k)"}
    write_json("no_stall", payload, args.out)


if __name__ == "__main__":
    main()
