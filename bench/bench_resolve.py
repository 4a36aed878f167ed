"""Benchmark adapter-source resolution against the local Hub server (the real huggingface_hub client).

- warm: resolving a pinned (commit sha) source that is cached: median time and HTTP requests made
  (target <= 5 ms, 0 requests);
- cold: resolving ``hf:org/repo:file.safetensors`` into an empty cache vs a plain ``hf_hub_download``
  of the same file into an empty cache (throughput and ratio).

Usage: python bench/bench_resolve.py [--size-mb 256] [--runs 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from hubserver import HubServer  # noqa: E402

SERVER = HubServer().start()
os.environ.update({"HF_ENDPOINT": SERVER.url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                   "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1"})

import json  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import save  # noqa: E402

from _common import median, print_table, timeit, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warm-runs", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import huggingface_hub.constants as hc
    from huggingface_hub import hf_hub_download

    from vllm_lora_ext import resolve_source

    n = args.size_mb * 2**20 // 2
    rank = 16
    weights = save({"base_model.model.m.q_proj.lora_A.weight": torch.zeros(rank, n // (2 * rank), dtype=torch.bfloat16),
                    "base_model.model.m.q_proj.lora_B.weight": torch.zeros(n // (2 * rank), rank, dtype=torch.bfloat16)})
    repo = SERVER.repo("bench/loras")
    repo.commit({"many/sql.safetensors": weights, "many/sql_config.json": json.dumps({"r": rank, "lora_alpha": 32}).encode(),
                 "many/other.safetensors": b"x" * 1024})
    size = len(weights)
    tmp = Path(tempfile.mkdtemp(prefix="bench-resolve-"))

    def fresh() -> None:
        shutil.rmtree(tmp / "cache", ignore_errors=True)
        (tmp / "cache").mkdir()
        hc.HF_HUB_CACHE = str(tmp / "cache")

    plain = timeit(lambda: hf_hub_download("bench/loras", "many/sql.safetensors"), runs=args.runs, setup=fresh)
    ours = timeit(lambda: resolve_source("hf:bench/loras:many/sql.safetensors"), runs=args.runs, setup=fresh)
    pinned = resolve_source("hf:bench/loras:many/sql.safetensors").source.canonical()
    before = SERVER.count()
    warm = timeit(lambda: resolve_source(pinned), runs=args.warm_runs, warmup=5)
    warm_requests = SERVER.count() - before
    os.environ["HF_HUB_OFFLINE"] = "1"
    warm_offline = timeit(lambda: resolve_source(pinned), runs=args.warm_runs, warmup=5)
    os.environ["HF_HUB_OFFLINE"] = "0"

    gbps = lambda t: size / t / 1e9  # noqa: E731
    rows = [
        ["cold: plain hf_hub_download (file only)", median(plain), gbps(median(plain)), 1.0],
        ["cold: resolve_source (file + config lookup)", median(ours), gbps(median(ours)), median(ours) / median(plain)],
        ["warm pinned, online", median(warm) * 1e3, "-", f"{warm_requests} HTTP requests"],
        ["warm pinned, HF_HUB_OFFLINE=1", median(warm_offline) * 1e3, "-", "0 HTTP requests"],
    ]
    print(f"file: {size / 2**20:.0f} MiB, {args.runs} cold runs (median), {args.warm_runs} warm runs (median)")
    print_table(rows, ["case", "seconds (warm: ms)", "GB/s", "ratio to plain / requests"])
    write_json("resolve", {
        "file_bytes": size, "cold_plain_s": plain, "cold_ours_s": ours, "cold_ratio": median(ours) / median(plain),
        "warm_pinned_ms_median": median(warm) * 1e3, "warm_pinned_requests": warm_requests,
        "warm_offline_ms_median": median(warm_offline) * 1e3,
    }, args.out)
    SERVER.stop()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
