"""Benchmark MoE expert-adapter loading: stock vLLM 0.26 vs vllm_lora_ext, on Qwen3-30B-A3B shapes.

Synthetic adapter: 48 layers x 128 experts, H=2048, I=768, r=16, bf16 (about 1.7 GB), saved as
2D per-expert keys (36,864 tensors) and as PEFT 3D target_parameters keys (192 tensors).

CPU mode (default): time until the adapter is fully materialized in the form handed to the GPU
(stock: ``LoRAModel.from_local_checkpoint`` + ``pack_moe`` / the 3D reshape; plugin: plan + read +
normalize), peak RSS of a fresh process per case, bytes read, against a raw read of the file.
Each case runs in its own subprocess; the page cache is warm (the file was just written) and the
raw read is timed the same way.

GPU mode (``--gpu``): real Qwen3-30B-A3B config (``--layers`` of its 48) with ``load_format="dummy"``; time from
``add_lora`` to the first generated token with that adapter, stock (plugin disabled) vs plugin, in
two engine processes. ``--first-run`` (issue 39 item 3): engines ``stock,plugin_nowarmup,plugin`` in turn
(``plugin_nowarmup``: ``VLLM_LORA_EXT_MOE_WARMUP=0``), each fresh, with its own empty Triton cache directory
so no engine reuses kernels another compiled; reports each engine's start-up (``LLM(...)``) and its first
2D adapter's ``add_lora`` -> first token against the median of runs 2+ (at least 7 runs; goal: <= 1.2x), which add
the same file again, and against as many adapters whose header bytes differ (``copy_new_header``: the plugin keeps
the last header and plan, which serve an adapter of the same shape and config but not one trained another way).
``--modes`` lists the engines, stock first;
a mode given twice runs twice (the spread between engines); ``plugin_old`` imports the package from ``--old-src``
first (``git archive <rev> src/vllm_lora_ext``, its ``src``): an earlier version beside this one in the same run;
``plugin_profile`` runs the engine core in the bench's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and profiles
runs 1 and 2 (``add_lora`` and the first step each, cProfile: its times run long), for what the first run does more.

Checks mode (``--checks``): what the load-time checks cost (strict header validation, factor dtypes,
the NaN/inf scan folded into each block's read), in one process, cases interleaved: the plugin read
with and without the checks, and the strict header parse against the lenient parse it replaced.

Usage: python bench/bench_moe_load.py [--layers 48] [--runs 3] [--gpu | --first-run | --checks] [--modes M,...]
    [--old-src DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, print_table, write_json  # noqa: E402

E, H, I, R, ALPHA = 128, 2048, 768, 16, 32


def make_adapter(folder: Path, layers: int, form: str) -> Path:
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    t: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        p = f"base_model.model.model.layers.{layer}.mlp.experts"
        a13 = (torch.randn(E, R, H, generator=g) * 0.01).bfloat16()
        b13 = (torch.randn(E, 2 * I, R, generator=g) * 0.01).bfloat16()
        ad = (torch.randn(E, R, I, generator=g) * 0.01).bfloat16()
        bd = (torch.randn(E, H, R, generator=g) * 0.01).bfloat16()
        if form == "2d":
            for e in range(E):
                t[f"{p}.{e}.gate_proj.lora_A.weight"] = a13[e].clone()
                t[f"{p}.{e}.gate_proj.lora_B.weight"] = b13[e, :I].clone()
                t[f"{p}.{e}.up_proj.lora_A.weight"] = a13[e].clone()
                t[f"{p}.{e}.up_proj.lora_B.weight"] = b13[e, I:].clone()
                t[f"{p}.{e}.down_proj.lora_A.weight"] = ad[e].clone()
                t[f"{p}.{e}.down_proj.lora_B.weight"] = bd[e].clone()
        else:
            t[f"{p}.base_layer.lora_A.weight"] = a13.reshape(E * R, H).contiguous()
            t[f"{p}.base_layer.lora_B.weight"] = b13.permute(1, 2, 0).reshape(2 * I, R * E).contiguous()
            t[f"{p}.lora_A.weight"] = ad.reshape(E * R, I).contiguous()
            t[f"{p}.lora_B.weight"] = bd.permute(1, 2, 0).reshape(H, R * E).contiguous()
    save_file(t, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": R, "lora_alpha": ALPHA, "target_modules": ["gate_proj", "up_proj", "down_proj"],
           "bias": "none", "peft_version": "0.21.0"}
    if form == "3d":
        cfg["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return folder


def copy_new_header(src: Path, dst: Path, tag: str) -> Path:
    """``src``'s adapter with the same tensors and a header of other bytes (its ``__metadata__`` names ``tag``): an
    adapter of the same shape that shares no header or plan the plugin keeps (``headers._KEPT_HEADERS``)."""
    import shutil
    import struct

    dst.mkdir(parents=True, exist_ok=True)
    with open(src / "adapter_model.safetensors", "rb") as f, open(dst / "adapter_model.safetensors", "wb") as out:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        header["__metadata__"] = {**header.get("__metadata__", {}), "format": "pt", "copy": tag}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        out.write(struct.pack("<Q", len(blob)) + blob)
        shutil.copyfileobj(f, out, 16 << 20)
    shutil.copy(src / "adapter_config.json", dst / "adapter_config.json")
    return dst


# ----------------------------------------------------------------------------------------------- CPU cases


def _case_raw(folder: Path, layers: int) -> dict:
    import torch

    t0 = time.perf_counter()
    path = folder / "adapter_model.safetensors"
    buf = torch.empty(path.stat().st_size, dtype=torch.uint8)
    with path.open("rb", buffering=0) as f:
        f.readinto(memoryview(buf.numpy()))  # one copy from the page cache into memory we own
    return {"seconds": time.perf_counter() - t0, "bytes_read": buf.numel(), "kept_bytes": buf.numel()}


def _no_pin() -> None:
    import vllm.lora.lora_model as lm
    import vllm.lora.lora_weights as lw
    import vllm.utils.torch_utils as tu

    for m in (lm, lw, tu):
        m.PIN_MEMORY = False


def _case_stock(folder: Path, layers: int, form: str) -> dict:
    import torch

    _no_pin()
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import PackedLoRALayerWeights
    from vllm.lora.peft_helper import PEFTHelper

    expected = {"experts", "gate_proj", "up_proj", "down_proj"}
    expected |= {f"experts.{e}.{p}" for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")}
    t0 = time.perf_counter()
    helper = PEFTHelper.from_local_dir(str(folder), 4096)
    lora = LoRAModel.from_local_checkpoint(str(folder), expected, helper, lora_model_id=1, device="cpu",
                                           dtype=torch.bfloat16)
    kept = 0
    for layer in range(layers):
        p = f"model.layers.{layer}.mlp.experts"
        if form == "2d":  # what LoRAModelManager._create_merged_loras_inplace does for a 2D MoE block
            subs = [lora.loras.pop(f"{p}.{e}.{n}") for e in range(E) for n in ("gate_proj", "down_proj", "up_proj")]
            packed = PackedLoRALayerWeights.pack_moe(subs, p)
            packed.optimize()
        else:  # what _convert_3d_to_2d_moe_lora does (mixed mode, the stock path for 3D on this model)
            gu, dn = lora.loras.pop(f"{p}.base_layer"), lora.loras.pop(p)
            for w in (gu, dn):
                w.optimize()
            a13 = gu.lora_a.reshape(E, -1, H).contiguous()
            b13 = gu.lora_b.reshape(2 * I, -1, E).permute(2, 0, 1).contiguous()
            ad = dn.lora_a.reshape(E, -1, I).contiguous()
            bd = dn.lora_b.reshape(H, -1, E).permute(2, 0, 1).contiguous()
            packed = PackedLoRALayerWeights(p, R, [1, 1, 1], [a13, ad, a13], [b13[:, :I].contiguous(), bd,
                                                                             b13[:, I:].contiguous()], [1.0] * 3)
        lora.loras[p] = packed
        kept += sum(t.numel() * t.element_size() for t in packed.lora_a + packed.lora_b
                    if t is not None and not (form == "3d" and t is packed.lora_a[2]))
    dt = time.perf_counter() - t0
    return {"seconds": dt, "bytes_read": (folder / "adapter_model.safetensors").stat().st_size, "kept_bytes": kept}


def plugin_read(folder: Path, *, experts: tuple[int, ...] | None = None, checks: bool = True) -> tuple[dict, int]:
    """The plugin's loading pipeline without vLLM: resolve, plan every MoE block by shape, read (only ``experts``).

    ``checks`` runs what the worker loader runs on every load (factor dtypes, the NaN/inf scan per block);
    ``checks=False`` exists only to measure their cost.
    """
    from vllm_lora_ext._util import gc_paused

    with gc_paused():  # as the worker loader runs it
        return _plugin_read(folder, experts=experts, checks=checks)


def _plugin_read(folder: Path, *, experts: tuple[int, ...] | None, checks: bool) -> tuple[dict, int]:
    import torch

    from vllm_lora_ext.validation import check_factor_dtypes

    from vllm_lora_ext.formats import group_moe_keys
    from vllm_lora_ext.formats.moe import MoESpec
    from vllm_lora_ext.formats.moe_plan import plan_experts
    from vllm_lora_ext.formats.moe_read import ReadOptions, read_blocks
    from vllm_lora_ext.transport import pools
    from vllm_lora_ext.reader import ReadStats, SafetensorsReader
    from vllm_lora_ext.sources import resolve_source
    from vllm_lora_ext.summary import load_config

    resolved = resolve_source(str(folder))
    config = load_config(resolved)
    stats = ReadStats()
    reader = SafetensorsReader(resolved.weights_path, stats=stats)
    if checks:
        check_factor_dtypes(reader.header.dtypes)
    groups = group_moe_keys(reader.header.shapes)
    plans = {p: plan_experts(g, MoESpec(p, E, H, I), config=config) for p, g in groups.items()}
    blocks = read_blocks(plans, reader, config=config,
                         experts={p: experts for p in plans} if experts is not None else None,
                         options=ReadOptions(dtype=torch.bfloat16, check_finite_as="bench" if checks else None,
                                             pools=pools))
    return blocks, stats.bytes_read


@dataclass(frozen=True)
class _OldTensorInfo:
    dtype: str
    shape: tuple
    nbytes: int


def _lenient_header(path: Path) -> tuple[dict, dict]:
    """The header parse as it was before the strict checks (commit 544dd85): the baseline of ``--checks``."""
    import struct

    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw = json.loads(f.read(n))
    raw.pop("__metadata__", None)
    infos, offsets = {}, {}
    for key, entry in sorted(raw.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        start, end = entry["data_offsets"]
        infos[key] = _OldTensorInfo(dtype=entry["dtype"], shape=tuple(entry["shape"]), nbytes=end - start)
        offsets[key] = (8 + n + start, 8 + n + end)
    return infos, offsets


def checks_bench(args: argparse.Namespace) -> dict:
    import gc

    import torch

    from vllm_lora_ext.reader import read_header

    torch.set_num_threads(1)  # as in vLLM's worker processes
    tmp = Path(tempfile.mkdtemp(prefix="bench-checks-"))
    rows, payload = [], {}
    for form in args.forms.split(","):
        folder = make_adapter(tmp / form, args.layers, form)
        weights = folder / "adapter_model.safetensors"
        plugin_read(folder)  # warm the page cache and the imports
        times: dict[str, list[float]] = {"checked": [], "unchecked": [], "strict_header": [], "lenient_header": []}
        for _ in range(args.runs):  # interleaved
            for case in ("checked", "unchecked"):
                gc.collect()
                t0 = time.perf_counter()
                blocks, _ = plugin_read(folder, checks=case == "checked")
                times[case].append(time.perf_counter() - t0)
                del blocks
            t0 = time.perf_counter()
            read_header(weights)
            times["strict_header"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            _lenient_header(weights)
            times["lenient_header"].append(time.perf_counter() - t0)
        m = {k: median(v) for k, v in times.items()}
        header_cost = m["strict_header"] - m["lenient_header"]
        scan_cost = m["checked"] - m["unchecked"]
        base = m["unchecked"] - header_cost  # the load as it was before any of the checks
        added = (header_cost + scan_cost) / base
        rows.append([form, base, m["unchecked"], m["checked"], header_cost, scan_cost, 100 * added])
        payload[form] = {"runs": times, "medians": m, "added_fraction": added}
        print(f"{form}: {weights.stat().st_size / 2**30:.2f} GiB")
    print_table(rows, ["layout", "load before checks s", "+ strict header s", "+ all checks s", "header cost s",
                       "dtype+finite cost s", "added %"])
    return {"mode": "checks", "layers": args.layers, "runs": args.runs, "results": payload, "table": rows}


def _case_plugin(folder: Path, layers: int, form: str) -> dict:
    t0 = time.perf_counter()
    blocks, bytes_read = plugin_read(folder)
    kept = 0
    out = []
    for ex in blocks.values():
        a, b = ex.as_2d(num_experts=E, hidden=H)
        seen: set[int] = set()
        for t in a + b:
            if id(t) not in seen:
                seen.add(id(t))
                kept += t.numel() * t.element_size()
        out.append((a, b))
    dt = time.perf_counter() - t0
    return {"seconds": dt, "bytes_read": bytes_read, "kept_bytes": kept}


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _run_case(case: str, folder: Path, layers: int, form: str) -> dict:
    import torch  # noqa: F401  (import cost outside the measurement)

    torch.set_num_threads(1)  # as in vLLM's worker processes
    if case == "stock":
        import vllm.lora.lora_model  # noqa: F401
        import vllm.lora.lora_weights  # noqa: F401
        import vllm.lora.peft_helper  # noqa: F401
    else:
        import vllm_lora_ext.formats.moe_read  # noqa: F401
        import vllm_lora_ext.summary  # noqa: F401
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    before = _rss("VmRSS")
    fn = {"raw": lambda: _case_raw(folder, layers), "stock": lambda: _case_stock(folder, layers, form),
          "plugin": lambda: _case_plugin(folder, layers, form)}[case]
    res = fn()
    res["peak_extra_rss"] = _rss("VmHWM") - before
    return res


def cpu_bench(args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-moe-"))
    rows, payload = [], {}

    def summary() -> dict:
        return {"mode": "cpu", "layers": args.layers, "shape": {"E": E, "H": H, "I": I, "r": R}, "results": payload,
                "table": rows}

    forms = args.forms.split(",")
    for form in forms:
        folder = make_adapter(tmp / form, args.layers, form)
        size = (folder / "adapter_model.safetensors").stat().st_size
        from safetensors import safe_open

        with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
            ntensors = len(list(f.keys()))
        res: dict[str, list[dict]] = {}
        for case in ("raw", "stock", "plugin"):
            res[case] = []
            for _ in range(args.runs):
                out = subprocess.run([sys.executable, __file__, "--_case", case, "--_folder", str(folder), "--_form", form,
                                      "--layers", str(args.layers)], capture_output=True, text=True)
                if out.returncode != 0:
                    raise RuntimeError(out.stderr[-3000:])
                res[case].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"{form} {case}: {res[case][-1]['seconds']:.3f} s", flush=True)  # as it comes
        raw_t = median([r["seconds"] for r in res["raw"]])
        for case in ("raw", "stock", "plugin"):
            t = median([r["seconds"] for r in res[case]])
            kept = res[case][0]["kept_bytes"]
            peak = median([r["peak_extra_rss"] for r in res[case]])
            rows.append([form, case, t, t / raw_t, size / t / 1e9, res[case][0]["bytes_read"] / 2**20, peak / 2**20,
                         peak / kept])
        payload[form] = {"file_bytes": size, "tensors": ntensors, "runs": res}
        print(f"{form}: {size / 2**30:.2f} GiB, {ntensors} tensors")
        if args.out and form != forms[-1]:  # so far (main writes the whole): a cut-short run keeps these
            write_json("moe_load_cpu", summary(), args.out)
    print_table(rows, ["layout", "case", "seconds", "x raw read", "GB/s", "MiB read", "peak extra RSS MiB",
                       "peak / kept bytes"])
    return summary()


# ----------------------------------------------------------------------------------------------- GPU


QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151645, "attention_bias": False, "attention_dropout": 0.0,
    "sliding_window": None, "use_sliding_window": False, "initializer_range": 0.02,
}


def gpu_engine(args: argparse.Namespace) -> None:
    """One engine process: add each adapter, then generate one token with it; print timings as JSON."""
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    t_start = time.perf_counter()
    llm = LLM(model=args._model, load_format="dummy", skip_tokenizer_init=True, enable_lora=True, max_lora_rank=16,
              max_loras=1, max_cpu_loras=8, enforce_eager=True, max_model_len=1024, gpu_memory_utilization=0.85,
              enable_mixed_moe_lora_format=True, seed=0)
    import vllm_lora_ext

    # which package this engine's plugin is (plugin_old: the --old-src tree), read back in the results
    out: dict = {"_start_s": time.perf_counter() - t_start, "_package": vllm_lora_ext.__file__}
    profiling = os.environ.get("LORA_BENCH_PROFILE") == "1"  # plugin_profile: runs 1 and 2, in-process engine
    adds = [(f"{form}-{rep}", form, Path(args._adapters) / form, rep < 2 and profiling)
            for rep in range(args.runs) for form in args.forms.split(",")]
    # then the same adapter under other header bytes, one each (after the runs above: the plugin keeps one header)
    first = args.forms.split(",")[0]
    adds += [(f"{first}_new-{k}", f"{first}_new", Path(args._adapters) / f"{first}-new-{k}", False)
             for k in range(args._new)]
    for i, (name, key, folder, profiled) in enumerate(adds, start=1):
        req = LoRARequest(lora_name=name, lora_int_id=i, lora_path=str(folder), is_3d_lora_weight=key.startswith("3d"))
        timed, profiles = _timed_first_token(llm, req, profiled)
        out.setdefault(key, []).append(timed)
        if profiles:
            out.setdefault("_profiles", []).append({"run": len(out[key]), **profiles})
    print("RESULT " + json.dumps(out), flush=True)


def _timed_first_token(llm: Any, req: Any, profiled: bool) -> tuple[dict, dict]:
    """``add_lora(req)``, then one token with it: both times (and their profiles where ``profiled``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    profile = cProfile.Profile() if profiled else None
    t0 = time.perf_counter()
    _under(profile, lambda: llm.llm_engine.add_lora(req))
    t1 = time.perf_counter()
    stats_add = _top(profile)
    profile = cProfile.Profile() if profiled else None
    _under(profile, lambda: llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4])],
                                         SamplingParams(max_tokens=1, detokenize=False), lora_request=req,
                                         use_tqdm=False))
    t2 = time.perf_counter()
    profiles = {"add_lora": stats_add, "first_step": _top(profile)} if profiled else {}
    return {"add_lora": t1 - t0, "first_step": t2 - t1, "total": t2 - t0}, profiles


def _under(profile: Any, call: Any) -> None:
    if profile is None:
        call()
        return
    profile.enable()
    try:
        call()
    finally:
        profile.disable()


def _top(profile: Any, n: int = 150) -> str | None:
    """The profiled call's top functions by cumulative and by own time (``plugin_profile``: run 1 against run 2). 150
    lines: r38's 45 left 0.05 s of run 1's worker ``add_adapter``, outside the load, unsplit."""
    if profile is None:
        return None
    import io
    import pstats

    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text).strip_dirs()
    stats.sort_stats("cumulative").print_stats(n)
    stats.sort_stats("tottime").print_stats(n // 2)
    return text.getvalue()


def first_run_summary(results: dict, modes: list[str], form: str) -> None:
    """Print (and add to ``results``) each engine's start-up and its first run against runs 2+ (goal <= 1.2x): runs
    2+ add the first adapter's file again (an adapter of the same shape and config has the same header bytes, so the
    plugin's kept header and plan serve it), and the new-header runs a copy whose header differs (an adapter trained
    another way parses and plans its own)."""
    rows = []
    for mode in modes:
        runs = [r["total"] for r in results[mode][form]]
        later = median(runs[1:])
        fresh = [r["total"] for r in results[mode].get(f"{form}_new", [])]
        new = median(fresh) if fresh else None
        ratio = runs[0] / later
        results[mode]["_first_run"] = {"start_s": results[mode]["_start_s"], "first_s": runs[0], "runs_2on_s": later,
                                       "ratio": ratio, "goal_met": ratio <= 1.2, "new_header_runs_s": new,
                                       "ratio_new_header": runs[0] / new if new else None}
        rows.append([mode, results[mode]["_start_s"], runs[0], later, ratio, "met" if ratio <= 1.2 else "NOT met",
                     new if new else "-", runs[0] / new if new else "-"])
    print_table(rows, ["engine", "start-up s", f"first run ({form}) add_lora->1st token s", "runs 2+ s (median)",
                       "first / runs 2+", "goal <= 1.2x", "new-header runs s (median)", "first / new-header"])


def gpu_bench(args: argparse.Namespace) -> dict:
    tmp = Path(args.workdir or tempfile.mkdtemp(prefix="bench-moe-gpu-"))
    model = tmp / "qwen3-30b-a3b"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, "num_hidden_layers": args.layers}))
    adapters = tmp / "adapters"
    for form in ("2d", "3d"):
        if not (adapters / form / "adapter_model.safetensors").exists():
            make_adapter(adapters / form, args.layers, form)
    new = args.runs - 1 if args.first_run else 0  # as many new-header adapters (of the first form) as runs 2+
    first = args.forms.split(",")[0]
    for k in range(new):
        if not (adapters / f"{first}-new-{k}" / "adapter_model.safetensors").exists():
            copy_new_header(adapters / first, adapters / f"{first}-new-{k}", str(k))
    results, logs = {}, {}
    modes = args.modes.split(",")
    if modes[0] != "stock":
        raise SystemExit("--modes: stock first (every ratio is against it)")
    for n, mode in enumerate(modes):
        if mode in results:  # a mode run again (its spread between engines): its own name
            mode = modes[n] = f"{mode}#{n}"
        env = dict(os.environ, VLLM_LORA_EXT_DISABLE="1" if mode == "stock" else "0")
        if mode.startswith("plugin_nowarmup"):
            env["VLLM_LORA_EXT_MOE_WARMUP"] = "0"
        if mode.startswith("plugin_profile"):  # the engine core in this process, so one profiler sees the step
            env.update(LORA_BENCH_PROFILE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        if mode.startswith("plugin_old"):
            if not args.old_src:
                raise SystemExit("--modes plugin_old needs --old-src")
            env["PYTHONPATH"] = os.pathsep.join(p for p in (args.old_src, env.get("PYTHONPATH")) if p)
        if args.first_run:  # a fresh server: no Triton kernel another engine of this run compiled to disk
            env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"triton-{mode}-", dir=tmp)
        out = subprocess.run([sys.executable, __file__, "--_engine", "--_model", str(model), "--_adapters", str(adapters),
                              "--runs", str(args.runs), "--forms", args.forms, "--_new", str(new)],
                             capture_output=True, text=True, env=env,
                             timeout=900)
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        if not line:
            raise RuntimeError(f"{mode} engine failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
        results[mode] = json.loads(line[-1][len("RESULT "):])
        logs[mode] = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if "[vllm_lora_ext" in ln]
        if args.out:  # so far: a run cut short keeps the engines done
            write_json("moe_load_gpu", {"partial": True, "modes": modes[:n + 1], "results": results}, args.out)
    rows = []

    def runs_2on(mode: str, form: str) -> dict:
        got = results[mode][form]
        return {k: median([r[k] for r in got[1:] or got]) for k in ("add_lora", "first_step", "total")}

    for form in args.forms.split(","):
        s = runs_2on("stock", form)
        for mode in modes[1:]:
            p = runs_2on(mode, form)
            rows.append([form, mode, s["add_lora"], s["first_step"], s["total"], p["add_lora"], p["first_step"],
                         p["total"], s["total"] / p["total"], results[mode][form][0]["total"]])
    print_table(rows, ["layout", "loader", "stock add_lora", "stock 1st step", "stock total", "add_lora", "1st step",
                       "total", "speed-up", "first run total"])
    if args.first_run:
        first_run_summary(results, modes, args.forms.split(",")[0])
    return {"mode": "gpu", "model": f"Qwen3-30B-A3B config, {args.layers} layers, load_format=dummy", "modes": modes,
            "old_src": args.old_src,
            "first_run": args.first_run, "results": results,
            "table": rows,  # the worker's phases: describing the model, building, wrapping
            "plugin_logs": {m: logs[m] for m in modes[1:]}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--first-run", action="store_true",
                    help="GPU: the first adapter's add_lora -> first token in a fresh engine against runs 2+, and the "
                         "start-up time, for stock, the plugin without the MoE kernel warm-up and with it")
    ap.add_argument("--old-src", default=None,
                    help="GPU: the package folder (git archive <rev> src/vllm_lora_ext, its src/) that engines of mode "
                         "plugin_old import first: an earlier version beside this one in the same run")
    ap.add_argument("--modes", default=None,
                    help="GPU mode: engines to run in turn, stock first (a plugin mode may repeat, to see the noise); "
                         "default stock,plugin, and with --first-run stock,plugin_nowarmup,plugin")
    ap.add_argument("--checks", action="store_true", help="CPU: cost of the load-time checks, same run")
    ap.add_argument("--forms", default="2d,3d", help="which layouts (2d,3d), in this order")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--_case")
    ap.add_argument("--_folder")
    ap.add_argument("--_form")
    ap.add_argument("--_engine", action="store_true")
    ap.add_argument("--_model")
    ap.add_argument("--_adapters")
    ap.add_argument("--_new", type=int, default=0)
    args = ap.parse_args()
    if args._case:
        print(json.dumps(_run_case(args._case, Path(args._folder), args.layers, args._form)))
        return
    if args._engine:
        gpu_engine(args)
        return
    if args.checks:
        write_json("moe_load_checks_cpu", checks_bench(args), args.out)
        return
    if args.first_run:
        args.gpu = True
        args.modes = args.modes or "stock,plugin_nowarmup,plugin"
        args.forms = args.forms if args.forms != "2d,3d" else "2d"
        args.runs = max(args.runs, 7)  # runs 2+ are a median of 6: with 2 (r38-r40) their spread set the ratio
    args.modes = args.modes or "stock,plugin"
    payload = gpu_bench(args) if args.gpu else cpu_bench(args)
    write_json("moe_load_gpu" if args.gpu else "moe_load_cpu", payload, args.out)


if __name__ == "__main__":
    main()
