"""Benchmark the safetensors header parse of a Qwen3-30B-A3B-shaped 2D expert adapter (9,216 keys at 12 layers,
36,864 at 48): what a load spends before it reads a tensor.

In one process, interleaved, median of ``--reps``:

- **plugin**: `read_header` (msgspec's typed decode and list-wide checks; every entry checked as strictly as
  safetensors checks it, see `read_header`);
- **entry by entry**: the fallback `read_header` takes without msgspec or for a header it refuses in bulk (json,
  then each entry checked in Python);
- **baseline** (``--baseline FILE``): another ``reader.py``'s `read_header`, loaded as a module (e.g. the round
  before's, from ``git show``), checked to give the same header;
- **stock**: what stock vLLM's loader learns of the same file (``safe_open``: safetensors' Rust parse of the
  header, then every key's shape and dtype through ``get_slice``), the same facts without the plugin's maps.

Usage: python bench/bench_header.py [--layers 12,48] [--reps 15] [--baseline OLD_READER.py] [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, print_table, write_json  # noqa: E402
from bench_moe_load import make_adapter  # noqa: E402


def _load_module(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("vllm_lora_ext._bench_baseline_reader", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look themselves up there)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    from safetensors import safe_open

    import vllm_lora_ext.headers as reader  # (the header parse and its decoders)

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="12,48")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--baseline", default=None, help="another reader.py whose read_header to time beside")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    baseline = _load_module(args.baseline) if args.baseline else None

    def stock(path: Path) -> None:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                s = f.get_slice(key)
                s.get_shape(), s.get_dtype()

    def one_by_one(path: Path) -> Any:
        saved = reader._DECODERS
        reader._DECODERS = None
        try:
            return reader.read_header(path)
        finally:
            reader._DECODERS = saved

    cases: dict[str, Any] = {"plugin": reader.read_header, "entry by entry": one_by_one, "stock (safe_open)": stock}
    if baseline is not None:
        cases["baseline"] = baseline.read_header
    tmp = Path(tempfile.mkdtemp(prefix="bench-header-"))
    rows, payload = [], {}
    for layers in map(int, args.layers.split(",")):
        path = make_adapter(tmp / f"l{layers}", layers, "2d") / "adapter_model.safetensors"
        os.sync()
        mine = reader.read_header(path)
        others = {"entry by entry": one_by_one(path)}
        if baseline is not None:
            others["baseline"] = baseline.read_header(path)
        same = {name: all(list(getattr(h, f).items()) == list(getattr(mine, f).items())
                          for f in ("shapes", "dtypes", "nbytes", "offsets")) and h.metadata == mine.metadata
                for name, h in others.items()}
        times: dict[str, list[float]] = {name: [] for name in cases}
        for fn in cases.values():  # warm
            fn(path)
        for r in range(args.reps):
            for name, fn in (list(cases.items()) if r % 2 == 0 else list(cases.items())[::-1]):
                t = time.perf_counter()
                fn(path)
                times[name].append(time.perf_counter() - t)
        med = {name: median(v) * 1e3 for name, v in times.items()}
        for name in cases:
            rows.append([layers, len(mine.shapes), name, med[name], med[name] / med["stock (safe_open)"],
                         med[name] / med["plugin"]])
        payload[str(layers)] = {"keys": len(mine.shapes), "header_bytes": mine.header_bytes, "ms": times,
                                "median_ms": med, "same_header_as_plugin": same}
        print(f"{layers} layers: the same header from every parse: {same}", flush=True)
    print_table(rows, ["layers", "keys", "parse", "ms (median)", "/ stock", "/ plugin"])
    write_json("header", {"reps": args.reps, "results": payload, "table": rows}, args.out)


if __name__ == "__main__":
    main()
