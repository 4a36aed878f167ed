"""Probe: a mix's GPU concatenation (staging.concat_staged) by where its components live, with a phase split.

Components are the four r16 7B-shaped adapters of bench_mix (281 MiB composite): in plain pageable tensors,
or each adapter in one host arena pinned in place (as the worker builds them). Medians of --reps.
``--baseline FILE`` also times another version of ``staging.py`` (e.g. ``git show REV:src/.../staging.py``) in
the same run, rep by rep in alternating order, and checks that both build the same composite bit for bit.

Usage: python bench/probe_gpu_concat.py [--reps 5] [--baseline FILE] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, print_table, write_json  # noqa: E402
from bench_mix import seven_b_adapters  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--baseline", default=None, help="another staging.py to time in the same run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from vllm_lora_ext.transport.arena import HostArena
    from vllm_lora_ext.integration import staging
    from vllm_lora_ext.transport import staging as pieces
    from vllm_lora_ext.integration._compat import pin_in_place

    torch.zeros(1, device="cuda")
    ads = seven_b_adapters()
    weights = [0.4, 0.3, 0.2, 0.1]
    plain = {k: ([(ad[k][0], ad[k][1], w) for ad, w in zip(ads, weights)], 0, 1) for k in ads[0]}
    pinned_ads = []
    for ad in ads:
        arena = HostArena(sum(a.nbytes + b.nbytes + 256 for a, b in ad.values()))
        moved = {}
        for k, (a, b) in ad.items():
            ta, tb = arena.empty(tuple(a.shape), a.dtype), arena.empty(tuple(b.shape), b.dtype)
            ta.copy_(a)
            tb.copy_(b)
            moved[k] = (ta, tb)
        assert pin_in_place(arena)
        arena.close()
        pinned_ads.append(moved)
    pinned = {k: ([(ad[k][0], ad[k][1], w) for ad, w in zip(pinned_ads, weights)], 0, 1) for k in ads[0]}
    phases: dict[str, list[float]] = {}
    runs: list[int] = []

    def timed(name, fn):
        def run(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            phases.setdefault(name, []).append(time.perf_counter() - t0)
            return out
        return run

    def counted(fn):
        def run(*a, **kw):
            out = fn(*a, **kw)
            runs.append(len(out))
            return out
        return run

    versions = {"this tree": staging}
    if args.baseline:
        import importlib.util

        spec = importlib.util.spec_from_file_location("staging_baseline", args.baseline)
        assert spec is not None and spec.loader is not None
        versions["baseline"] = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # (its dataclasses)
        spec.loader.exec_module(versions["baseline"])
    orig_units = pieces._units
    for mod in [pieces] + [m for v, m in versions.items() if v != "this tree"]:  # (this tree's pieces: transport)
        mod._upload, mod._place, mod._units = (timed("upload calls", mod._upload), timed("place calls", mod._place),
                                               timed("units", mod._units))
        mod._stacked = counted(mod._stacked)
    cases = [(v, name, jobs) for v in versions for name, jobs in (("pageable", plain), ("pinned arenas", pinned))]
    times: dict[str, list[float]] = {f"{v}, {name}": [] for v, name, _ in cases}
    split: dict[str, dict[str, float]] = {}
    calls: dict[str, int] = {}
    same = True
    for rep in range(args.reps + 1):
        results = {}
        for v, name, jobs in (cases if rep % 2 else cases[::-1]):
            phases.clear()
            runs.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            done = versions[v].concat_staged(jobs, dtype=torch.bfloat16, device="cuda:0")
            dt = time.perf_counter() - t0
            assert done is not None
            label = f"{v}, {name}"
            if rep:
                times[label].append(dt)
                split[label] = {k: sum(ts) * 1000 for k, ts in phases.items()}
                calls[label] = sum(runs)
            results[label] = done[0]
        if len(versions) > 1:  # both versions build the same composite, bit for bit
            for name in ("pageable", "pinned arenas"):
                a, b = results[f"this tree, {name}"], results[f"baseline, {name}"]
                same = same and all(torch.equal(x, y) for k in a for x, y in zip(a[k], b[k]))
        del results, done
    # What the upload would cost as bare DMAs: each component's pinned arena span to one GPU buffer, timed alone.
    spans = []
    for ad in pinned_ads:
        ts = [t for ab in ad.values() for t in ab]
        lo = min(t.data_ptr() for t in ts)
        hi = max(t.data_ptr() + t.nbytes for t in ts)
        flat = torch.empty(0, dtype=torch.uint8).set_(ts[0].untyped_storage())
        spans.append(flat[lo - flat.data_ptr():hi - flat.data_ptr()])
    target = torch.empty(sum(s.numel() for s in spans), dtype=torch.uint8, device="cuda")
    dma: list[float] = []
    for rep in range(args.reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        off = 0
        for span in spans:
            target[off:off + span.numel()].copy_(span, non_blocking=True)
            off += span.numel()
        issued = time.perf_counter() - t0
        torch.cuda.synchronize()
        if rep:
            dma.append(time.perf_counter() - t0)
    print(f"bare DMA of the four pinned spans ({target.numel() / 2**20:.0f} MiB): {median(dma) * 1000:.1f} ms "
          f"(last issue {issued * 1000:.1f} ms); all pinned: {all(s.is_pinned() for s in spans)}")
    srcs = [t for parts, _, _ in pinned.values() for p in parts for t in p[:2]]
    units = orig_units(srcs, pieces._pinned_per_storage())
    rows = [[name, median(ts) * 1000, calls[name], ", ".join(f"{k} {v:.0f} ms" for k, v in split[name].items())]
            for name, ts in times.items()]
    print_table(rows, ["version, components in", "concat_staged ms (median)", "copies", "last rep: time in"])
    print(f"pinned arenas: {len(units)} upload units, {sum(u.span for u in units)} spans")
    if len(versions) > 1:
        print(f"this tree and the baseline built the same composites bit for bit: {same}")
    write_json("probe_gpu_concat", {"reps": args.reps, "ms": {k: [t * 1000 for t in v] for k, v in times.items()},
                                    "copies": calls, "same_as_baseline": same if len(versions) > 1 else None,
                                    "split_last_rep_ms": split, "units": len(units),
                                    "spans": sum(u.span for u in units), "bare_dma_ms": [t * 1000 for t in dma],
                                    "bare_dma_issue_ms_last": issued * 1000}, args.out)


if __name__ == "__main__":
    main()
