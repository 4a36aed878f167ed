"""Benchmark expert-parallel reads: what one rank reads of a Qwen3-30B-A3B-shaped expert adapter at EP = 1, 2, 4, 8.

Stock vLLM 0.26: 2D keys of remote experts are skipped at read time (``MoEEPLoadSpec``), then packed;
3D tensors are read in full and sliced after. Plugin: the worker's own build (``building.build_adapter``:
resolve, header, plan, read into a host arena, checks, pack) for a model whose rank holds the first E/EP
experts; 2D keys of remote experts are never read, 3D tensors are read as row ranges of A and column ranges
of B for the local experts only.

Each case runs in a fresh subprocess and times two loads there: the first in the process (peak RSS = VmHWM
after a reset) and the next one, as a serving process that has loaded an adapter before loads it (its
imports, allocator and thread pools warm). A final check asserts the plugin's rank tensors equal the full
read, then sliced. Rounds are interleaved: each runs every case once, in alternating order.

Usage: python bench/bench_ep_read.py [--layers 48] [--runs 2] [--forms 2d,3d] [--eps 1,2,4,8] [--no-check] [--out FILE]
(on a lent H100 host, ``--layers 12 --runs 3 --forms 3d --eps 8`` took 224 s; both layouts at every EP size ran past
a 560 s call)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, print_table, write_json  # noqa: E402
from bench_moe_load import E, H, I, _no_pin, _rss, make_adapter  # noqa: E402


def _stock(folder: Path, layers: int, form: str, ep: int) -> dict:
    import torch

    _no_pin()
    from vllm.lora.lora_model import LoRAModel, MoEEPLoadSpec
    from vllm.lora.lora_weights import PackedLoRALayerWeights
    from vllm.lora.peft_helper import PEFTHelper

    local = E // ep
    expected = {"experts", "gate_proj", "up_proj", "down_proj"}
    expected |= {f"experts.{e}.{p}" for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")}
    t0 = time.perf_counter()
    helper = PEFTHelper.from_local_dir(str(folder), 4096)
    spec = MoEEPLoadSpec(ep_rank=0, local_num_experts=local, global_num_experts=E) if ep > 1 else None
    lora = LoRAModel.from_local_checkpoint(str(folder), expected, helper, lora_model_id=1, device="cpu",
                                           dtype=torch.bfloat16, moe_ep_spec=spec)
    for layer in range(layers):
        p = f"model.layers.{layer}.mlp.experts"
        if form == "2d":
            subs = [lora.loras.pop(f"{p}.{e}.{n}") for e in range(local) for n in ("gate_proj", "down_proj", "up_proj")]
            PackedLoRALayerWeights.pack_moe(subs, p).optimize()
        else:  # _convert_3d_to_2d_moe_lora: reshape, keep the local experts, drop the rest
            gu, dn = lora.loras.pop(f"{p}.base_layer"), lora.loras.pop(p)
            lora.loras[p] = [gu.lora_a.reshape(E, -1, H)[:local].contiguous(),
                             gu.lora_b.reshape(2 * I, -1, E)[..., :local].permute(2, 0, 1).contiguous(),
                             dn.lora_a.reshape(E, -1, I)[:local].contiguous(),
                             dn.lora_b.reshape(H, -1, E)[..., :local].permute(2, 0, 1).contiguous()]
    dt = time.perf_counter() - t0
    size = (folder / "adapter_model.safetensors").stat().st_size
    return {"seconds": dt, "bytes_read": size if form == "3d" or ep == 1 else None}


def _plugin(folder: Path, layers: int, form: str, ep: int) -> dict:
    import torch

    from vllm_lora_ext.building import BuildJob, build_adapter
    from vllm_lora_ext.formats.moe import MoESpec
    from vllm_lora_ext.planning import ModelSpec, PeftKeyRouter

    blocks = [f"model.layers.{layer}.mlp.experts" for layer in range(layers)]
    model = ModelSpec(frozenset(), moe={p: MoESpec(p, E, H, I) for p in blocks},
                      local_experts={p: tuple(range(E // ep)) for p in blocks} if ep > 1 else {}, max_rank=16)
    job = BuildJob(str(folder), "bench", model, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    built = build_adapter(job, PeftKeyRouter())
    return {"seconds": time.perf_counter() - t0, "bytes_read": built.bytes_read}


def _case(which: str, folder: Path, layers: int, form: str, ep: int) -> dict:
    import gc

    import torch

    torch.set_num_threads(1)
    if which == "stock":
        import vllm.lora.lora_model  # noqa: F401
        import vllm.lora.peft_helper  # noqa: F401
    else:  # what a vLLM worker has imported before it loads an adapter (prometheus_client: vLLM's metrics)
        import prometheus_client  # noqa: F401

        import vllm_lora_ext.building  # noqa: F401
        import vllm_lora_ext.summary  # noqa: F401
    load = _stock if which == "stock" else _plugin
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = _rss("VmRSS")
    res = load(folder, layers, form, ep)
    res["peak_extra_rss"] = _rss("VmHWM") - before
    gc.collect()
    res["next_seconds"] = load(folder, layers, form, ep)["seconds"]  # the same load again, in a warm process
    return res


def _check(folder: Path, form: str, layers: int) -> bool:
    """Bitwise: the worker build for rank 1 of EP=4 (and for a round-robin placement) equals the full read, then
    indexed."""
    import torch

    from vllm_lora_ext.building import BuildJob, build_adapter
    from vllm_lora_ext.formats.moe import MoESpec
    from vllm_lora_ext.planning import ModelSpec, PeftKeyRouter

    blocks = [f"model.layers.{layer}.mlp.experts" for layer in range(layers)]
    moe = {p: MoESpec(p, E, H, I) for p in blocks}

    def build(ids: list[int] | None) -> dict:
        model = ModelSpec(frozenset(), moe=moe, local_experts={p: tuple(ids) for p in blocks} if ids else {},
                          max_rank=16)
        return build_adapter(BuildJob(str(folder), "check", model, dtype=torch.bfloat16), PeftKeyRouter()).moe

    full = build(None)
    for ids in (list(range(32, 64)), list(range(1, E, 4))):
        part = build(ids)
        for p in blocks:
            (fa, fb, _), (pa, pb, _) = full[p], part[p]
            if not all(torch.equal(f[ids], g) for f, g in zip(fa + fb, pa + pb)):
                return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--forms", default="2d,3d")
    ap.add_argument("--eps", default="1,2,4,8", help="EP sizes to time (1 is always timed: ratios are to it)")
    ap.add_argument("--no-check", action="store_true", help="skip the final bitwise check")
    ap.add_argument("--_case")
    ap.add_argument("--_folder")
    ap.add_argument("--_form")
    ap.add_argument("--_ep", type=int)
    args = ap.parse_args()
    if args._case:
        print(json.dumps(_case(args._case, Path(args._folder), args.layers, args._form, args._ep)))
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench-ep-"))
    rows, payload = [], {}
    forms = args.forms.split(",")
    eps = sorted({1, *map(int, args.eps.split(","))})
    for form in forms:
        folder = make_adapter(tmp / form, args.layers, form)
        # the adapter just written is still being written back to disk: timing beside that writeback measured
        # the disk (round 11, dev VM: a third of the CPU time in iowait, next-load ratios doubled)
        os.sync()
        cases = [(ep, which) for ep in eps for which in ("stock", "plugin")]
        runs: dict[tuple[int, str], list[dict]] = {c: [] for c in cases}
        for r in range(args.runs):  # interleaved: each round runs every case once (the dev VM's speed drifts)
            for ep, which in (cases if r % 2 == 0 else cases[::-1]):
                o = subprocess.run([sys.executable, __file__, "--_case", which, "--_folder", str(folder), "--_form",
                                    form, "--_ep", str(ep), "--layers", str(args.layers)], capture_output=True, text=True)
                if o.returncode:
                    raise RuntimeError(o.stderr[-3000:])
                runs[(ep, which)].append(json.loads(o.stdout.strip().splitlines()[-1]))
                got = runs[(ep, which)][-1]  # as it comes: a run cut short still shows what it measured
                print(f"{form} EP={ep} {which}: first {got['seconds']:.3f} s, next {got['next_seconds']:.3f} s",
                      flush=True)
        ep1 = None
        for ep, which in cases:
            outs = runs[(ep, which)]
            t = median([x["seconds"] for x in outs])
            tn = median([x["next_seconds"] for x in outs])
            b = outs[0]["bytes_read"]
            if which == "plugin" and ep == 1:
                ep1 = (t, b, tn)
            payload.setdefault(form, {}).setdefault(str(ep), {})[which] = outs
            mine = which == "plugin" and ep1
            rows.append([form, ep, which, t, (t / ep1[0]) if mine else "-", tn, (tn / ep1[2]) if mine else "-",
                         (b / 2**20) if b else "(local keys)", (b / ep1[1]) if mine and b else "-",
                         median([x["peak_extra_rss"] for x in outs]) / 2**20])
        write_json("ep_read", {"layers": args.layers, "results": payload, "table": rows}, args.out)  # before the check
        payload[form]["bitwise_equal_to_full_then_slice"] = None if args.no_check else _check(folder, form, args.layers)
        write_json("ep_read", {"layers": args.layers, "results": payload, "table": rows}, args.out)  # each layout
    print_table(rows, ["layout", "EP", "loader", "first load s", "time / EP1", "next load s", "next / EP1", "MiB read",
                       "bytes / EP1", "peak extra RSS MiB"])
    print("plugin rank tensors == full read then slice (contiguous and round-robin):",
          {f: payload[f]["bitwise_equal_to_full_then_slice"] for f in forms})


if __name__ == "__main__":
    main()
