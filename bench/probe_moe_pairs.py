"""GPU probe (issue 39 item 1): the fused-MoE LoRA step of one decode batch, vLLM's one-shot kernel against a
two-kernel pair path the plugin serves such batches with (``vllm_lora_ext.integration.moe_pairs``), on the
Qwen3-30B-A3B shape.

vLLM 0.26's one-shot kernel gives each (token, expert) pair of a small batch (its "naive block assignment", taken
when a batch's pairs are few against ``num_experts x max_loras``: 32 tokens at 16 slots) a whole program: a 16-row
tensor-core tile of which one row is the pair, the rank-r shrink over all of K, then the expand over all of N, in
sequence. The candidate splits the shrink into one program per (pair, slice, block of K), each writing an fp32
partial, and the expand into one program per (pair, slice, block of N), which sums the partials, rounds them to
bf16 (as the one-shot rounds its shrink) and adds the delta, times the routed weight where vLLM applies it.

For w13 (two slices, K = hidden, N = intermediate) and w2 (one slice, K = intermediate, N = hidden, routed weights
applied), with one adapter for every token and with ``--slots`` distinct ones (one request without an adapter in
each), both run the same inputs: each call captured ``--calls`` times in one CUDA graph, the graph replayed
``--reps`` times, twice interleaved, the median microseconds per call reported for every ``--configs`` tried.
Both outputs are compared with an fp32 reference (the shrink rounded to bf16, the output rounded once): the
candidate's largest error must not exceed vLLM's by more than one bf16 step of the output. Then one MoE layer's
whole LoRA step (w13, then w2) through vLLM's ``PunicaWrapperGPU`` in a CUDA graph, with the plugin registered,
its pair path against vLLM's kernel (``VLLM_LORA_EXT_KERNEL_CONFIGS=0``) for each ``--layer-shapes`` shape, 3
times interleaved; where a shape's rank is above ``--live-rank``, also with adapters of that rank in its slots
and the pair path reading only their rows (the slots' live-rank table, ``integration.slot_ranks``). Prints tables and writes JSON; needs vLLM (the bundle) and a GPU.

    python bench/probe_moe_pairs.py --out results/probe_moe_pairs_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import env_info, graph_time_us, print_table, write_json  # noqa: E402


def make_inputs(args: argparse.Namespace, proj: str, slots_used: int, seed: int, live: int = 0) -> dict:
    """One projection's inputs; with ``live`` > 0, every slot holds a rank-``live`` adapter (zeros past it) and the
    pair path gets the slots' live-rank table."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    m, top_k, e, r = args.tokens, args.top_k, args.experts, args.rank
    if proj == "w13":
        slices, k, n, mul = 2, args.hidden, args.inter, False
        x = torch.randn(m, k, device=dev, dtype=dt, generator=g)
    else:
        slices, k, n, mul = 1, args.inter, args.hidden, True
        x = torch.randn(m * top_k, k, device=dev, dtype=dt, generator=g)
    a = tuple(torch.randn(args.max_loras, e, r, k, device=dev, dtype=dt, generator=g) * 0.02 for _ in range(slices))
    b = tuple(torch.randn(args.max_loras, e, n, r, device=dev, dtype=dt, generator=g) * 0.02 for _ in range(slices))
    scores = torch.rand(m, e, device=dev, generator=g)
    topk_w, topk_ids = torch.topk(torch.softmax(scores, -1), top_k, dim=-1)
    tmap = (torch.arange(m, device=dev) % slots_used).to(torch.int32)
    tmap[-1] = -1  # one request without an adapter
    enabled = torch.ones(args.max_loras + 1, dtype=torch.int32, device=dev)
    out = torch.randn(m, top_k, slices * n, device=dev, dtype=dt, generator=g)
    ranks = None
    if live:
        for t in a:
            t[:, :, live:].zero_()
        for t in b:
            t[..., live:].zero_()
        ranks = torch.full((args.max_loras,), live, dtype=torch.int32, device=dev)
    return dict(x=x, a=a, b=b, topk_w=topk_w.float(), eids=topk_ids.reshape(-1).to(torch.int32), tmap=tmap,
                enabled=enabled, out=out, mul=mul, slices=slices, n=n, ranks=ranks)


def reference(d: dict) -> torch.Tensor:
    m, top_k = d["topk_w"].shape
    pairs = m * top_k
    p = torch.arange(pairs, device="cuda")
    t = p // top_k
    lora, e = d["tmap"][t].long(), d["eids"].long()
    valid = (lora >= 0) & (e >= 0)
    lc, ec = lora.clamp(min=0), e.clamp(min=0)
    xin = d["x"][p if d["mul"] else t].float()
    ref = d["out"].float().view(pairs, -1).clone()
    n = d["n"]
    for s in range(d["slices"]):
        u = torch.einsum("prk,pk->pr", d["a"][s][lc, ec].float(), xin).bfloat16().float()
        delta = torch.einsum("pnr,pr->pn", d["b"][s][lc, ec].float(), u)
        if d["mul"]:
            delta = delta * d["topk_w"].reshape(-1, 1)
        ref[:, s * n:(s + 1) * n] += torch.where(valid[:, None], delta, 0.0)
    return ref


def call_vllm(d: dict, out: torch.Tensor) -> None:
    from vllm.lora.ops.triton_ops.fused_moe_lora_op import _fused_moe_lora

    rank = d["a"][0].shape[2]
    zeros = torch.zeros(d["a"][0].shape[0] + 1, dtype=torch.int32, device="cuda")
    _fused_moe_lora(out, d["x"], list(d["a"]), list(d["b"]), d["topk_w"], None, d["eids"], None, d["tmap"], rank,
                    d["topk_w"].shape[1], zeros, torch.tensor([1], dtype=torch.int32), d["enabled"],
                    16, 64, 32, 8, 4, 3, 1, 16, 64, 32, 8, 4, 3, 1, mul_routed_weight=d["mul"])


# (block_k, block_n, warps, expand rows a pass): r38's three fastest of 14 at r16, and r39's at r32 (H200)
CONFIGS = [(256, 128, 1, 16), (128, 128, 1, 16), (256, 128, 2, 16), (256, 64, 1, 16), (256, 64, 2, 32)]


def pairs_call(config: tuple[int, int, int, int], pdl: bool = False):
    from vllm_lora_ext.integration.moe_pairs import Launch, PairRouting, moe_lora_pairs

    def call(d: dict, out: torch.Tensor) -> None:
        routing = PairRouting(d["topk_w"], d["eids"], d["tmap"], d["enabled"], d["ranks"])
        moe_lora_pairs(out, d["x"], (d["a"], d["b"]), routing, mul_routed_weight=d["mul"],
                       launch=Launch(config, pdl))
    return call


def timed(fn, d: dict, calls: int, reps: int) -> float:
    """Microseconds per call of ``fn`` on ``d``: ``calls`` captured in one CUDA graph, the median of ``reps``
    replays (``_common.graph_time_us``)."""
    out = d["out"].clone()
    us = graph_time_us(lambda: fn(d, out), calls, what=fn, replays=reps)
    if us is None:
        raise RuntimeError(f"{fn} did not launch or capture (its line above says why)")
    return us


def _zero_past(step: Any, live: int) -> None:
    """Leave ``step``'s factors with ``live`` rank rows in each slot and zeros past them, as vLLM's ``set_lora``
    leaves a rank-``live`` adapter in larger slots."""
    for a in (*step.w13_a, *step.w2_a):
        a[:, :, live:, :].zero_()
    for b in (*step.w13_b, *step.w2_b):
        b[..., live:].zero_()


def layer_steps(shapes: str, reps: int, live: int,
                tiles: list[tuple[int, ...]]) -> tuple[list[list[Any]], list[dict[str, Any]]]:
    """One MoE layer's LoRA step (w13 then w2) through vLLM's ``PunicaWrapperGPU``, as the MoE experts launch it
    (the tuner's ``Step``, in a CUDA graph), with the plugin registered: vLLM's kernel
    (``VLLM_LORA_EXT_KERNEL_CONFIGS=0``), the pair path reading every rank row of the slots ("pairs"), and, for a
    shape whose rank is above ``live``, the slots holding rank-``live`` adapters (zeros past them) with the pair
    path told so through the live-rank table ("live"), ``reps`` times interleaved, for each ``slots,tokens,rank``;
    for a rank above 16, once with `moe_pairs.default_tiles` and once for each of ``tiles`` instead."""
    import os
    import tempfile

    import tune_moe_lora_kernels as tune

    from vllm_lora_ext.integration import moe_pairs, plugin, slot_ranks
    from vllm_lora_ext.kernel_configs import file_stem

    plugin.register()
    import vllm.lora.punica_wrapper.punica_gpu  # noqa: F401  (the patch applies as vLLM imports it)
    from vllm.lora.ops.triton_ops.utils import supports_pdl

    shipped = moe_pairs.default_tiles
    rows, results = [], []
    for text in shapes.split(";"):
        shape = tune.Shape(*map(int, text.split(",")))
        step = tune.Step(shape, Path(tempfile.mkdtemp()), file_stem(torch.cuda.get_device_name()))
        choices: list[tuple[int, ...] | None] = [None] + (list(tiles) if shape.rank > 16 else [])
        modes = ["vllm", "nopdl0"] + [f"{kind}{i}" for i in range(len(choices)) for kind in ("pairs", "live")
                                      if kind == "pairs" or 0 < live < shape.rank]
        if 0 < live < shape.rank:
            _zero_past(step, live)
        table = slot_ranks.rank_table(step.punica, shape.slots, "cuda")
        times: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
        for _ in range(reps):
            for mode in modes:
                os.environ.pop("VLLM_LORA_DISABLE_PDL", None)
                supports_pdl.cache_clear()  # vLLM caches its answer per process
                if mode == "vllm":
                    os.environ["VLLM_LORA_EXT_KERNEL_CONFIGS"] = "0"
                else:
                    os.environ.pop("VLLM_LORA_EXT_KERNEL_CONFIGS", None)
                    if mode.startswith("nopdl"):  # the pair path without programmatic dependent launch
                        os.environ["VLLM_LORA_DISABLE_PDL"] = "1"
                        supports_pdl.cache_clear()
                    chosen = choices[int(mode.removeprefix("pairs").removeprefix("live").removeprefix("nopdl"))]
                    moe_pairs.default_tiles = shipped if chosen is None else (lambda rank, c=chosen: c)
                table.fill_(live if mode.startswith("live") else slot_ranks.ALL_ROWS)
                times[mode].append(step.time_us(None) or {})
        moe_pairs.default_tiles = shipped
        os.environ.pop("VLLM_LORA_EXT_KERNEL_CONFIGS", None)
        os.environ.pop("VLLM_LORA_DISABLE_PDL", None)
        for label in step.mappings:
            us = {mode: statistics.median(t[label] for t in times[mode]) for mode in modes}
            for i, chosen in enumerate(choices):
                p, lv = us[f"pairs{i}"], us.get(f"live{i}")
                results.append(dict(shape=shape.key(), label=label, tiles=chosen or shipped(shape.rank),
                                    vllm_us=us["vllm"], pairs_us=p, live_us=lv, live_rank=live if lv else None,
                                    pairs_no_pdl_us=us["nopdl0"] if i == 0 else None,
                                    speedup=us["vllm"] / p, reps={m: times[m] for m in ("vllm", f"pairs{i}",
                                                                                        f"live{i}") if m in times}))
                rows.append([text, label, str(chosen or "default"), round(us["vllm"], 2),
                             round(us["nopdl0"], 2) if i == 0 else "-", round(p, 2),
                             round(lv, 2) if lv else "-", round(us["vllm"] / min(p, lv or p), 2)])
    return rows, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=16)
    ap.add_argument("--slots", default="1,16", help="distinct adapters among the tokens, per case")
    ap.add_argument("--live", default="0", help="live ranks to try, each its own cases: the slots hold adapters of "
                                               "that rank (zeros past it) and the pair path reads the table (0: none)")
    ap.add_argument("--configs", default=None, help="the pair path's block_k,block_n,warps,expand_rows;... to try")
    ap.add_argument("--layer-tiles", default="", help="block_k,block_n,warps,expand_rows;... tried in the layer "
                                                       "steps of a rank above 16 besides moe_pairs.default_tiles")
    ap.add_argument("--layer-shapes", default="16,32,16;16,32,32",
                    help="slots,tokens,rank;... of the layer steps timed through PunicaWrapperGPU ('' skips)")
    ap.add_argument("--live-rank", type=int, default=16,
                    help="layer shapes of a larger rank are also timed with rank-N adapters in their slots, the pair "
                         "path reading N rows of each (0: not)")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows, results = [], []
    cases = [(slots, live) for live in map(int, args.live.split(",")) for slots in map(int, args.slots.split(","))]
    for slots, live in cases:
        for proj in ("w13", "w2"):
            d = make_inputs(args, proj, slots, seed=slots * 10 + (proj == "w2"), live=live)
            ref = reference(d)
            configs = [tuple(map(int, c.split(","))) for c in args.configs.split(";")] if args.configs else CONFIGS
            impls = ([("vllm", call_vllm)] + [(f"pairs{c}", pairs_call(c)) for c in configs]
                     + [(f"pairs{configs[0]}+pdl", pairs_call(configs[0], True))])
            errs, us = {}, {}
            for name, fn in impls:
                out = d["out"].clone()
                fn(d, out)
                torch.cuda.synchronize()
                errs[name] = (out.float().view_as(ref) - ref).abs().max().item()
            for _ in range(2):  # interleaved
                for name, fn in impls:
                    us.setdefault(name, []).append(timed(fn, d, args.calls, args.reps))
            step = ref.abs().max().item() * 2 ** -8  # one bf16 step at the output's largest magnitude
            v = statistics.median(us["vllm"])
            for name, _ in impls[1:]:
                p = statistics.median(us[name])
                ok = errs[name] <= errs["vllm"] + step
                results.append(dict(slots=slots, live=live, proj=proj, config=name, vllm_us=v, pairs_us=p,
                                    speedup=v / p,
                                    vllm_err=errs["vllm"], pairs_err=errs[name], bf16_step=step, parity_ok=ok,
                                    vllm_us_reps=us["vllm"], pairs_us_reps=us[name]))
                rows.append([slots, live or "-", proj, name[5:], round(v, 2), round(p, 2), round(v / p, 2),
                             f"{errs['vllm']:.4g}", f"{errs[name]:.4g}", "yes" if ok else "NO"])
    print_table(rows, ["adapters", "live rank", "proj", "(block_k, block_n, warps)", "vLLM one-shot us", "pairs us", "speed-up",
                       "vLLM max err", "pairs max err", "parity"])
    tiles = [tuple(map(int, c.split(","))) for c in args.layer_tiles.split(";") if c]
    layer_rows, layer_results = (layer_steps(args.layer_shapes, 3, args.live_rank, tiles) if args.layer_shapes
                                 else ([], []))
    if layer_rows:
        print_table(layer_rows, ["layer step (slots,tokens,rank)", "adapters", "tiles", "vLLM us",
                                 "plugin without PDL us", "plugin us",
                                 f"plugin, rank-{args.live_rank} adapters us", "best speed-up"])
    payload = {"env": env_info(), "args": vars(args), "results": results, "layer_steps": layer_results}
    write_json("probe_moe_pairs", payload, args.out)
    if not all(r["parity_ok"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
