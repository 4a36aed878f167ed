"""Shared helpers for bench/ scripts: timing, table printing, JSON output with versions."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def timeit(fn: Callable[[], Any], *, runs: int = 5, warmup: int = 1, setup: Callable[[], Any] | None = None) -> list[float]:
    """Run ``fn`` ``warmup`` + ``runs`` times (``setup`` before each, untimed); return the timed seconds."""
    out = []
    for i in range(warmup + runs):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i >= warmup:
            out.append(dt)
    return out


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def env_info() -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0], "machine": platform.machine(), "cpus": os.cpu_count()}
    for mod in ("torch", "safetensors", "huggingface_hub", "vllm"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            info[mod] = None
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True).stdout.strip()
    except OSError:
        info["commit"] = None
    # On the lent GPU machine the copy's git HEAD is the session's first commit, not the working tree's: this
    # hash of the package's source is right everywhere (compare with `python bench/_common.py` at a commit).
    info["src_sha256"] = source_hash()
    try:
        import torch

        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:
        info["gpu"] = None
    return info


def source_hash() -> str:
    """SHA-256 (first 16 hex digits) over the package's ``.py`` files, by relative path and content."""
    import hashlib

    digest = hashlib.sha256()
    src = ROOT / "src" / "vllm_lora_ext"
    for path in sorted(src.rglob("*.py")):
        digest.update(str(path.relative_to(src)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def print_table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> None:
    cells = [[str(c) for c in header]] + [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for j, r in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def graph_time_us(launch: Any, reps: int, *, what: object, replays: int = 5) -> float | None:
    """Microseconds per ``launch()``: ``reps`` launches captured in one CUDA graph, the median of ``replays`` (after one
    launch outside the capture, which compiles and fills vLLM's pointer caches, and one untimed replay). None, with
    a line naming ``what``, where the launch or the capture fails (too much shared memory, a refused block shape)."""
    import torch

    try:
        launch()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                launch()
    except Exception as exc:
        print(f"  skip {what}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        torch.cuda.synchronize()
        return None
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def write_json(name: str, payload: dict[str, Any], out: str | None = None) -> Path:
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"env": env_info(), **payload}, indent=2, default=str))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    print(source_hash())


class PhaseTimes(dict):  # type: ignore[type-arg]
    """Seconds per phase, summed over every call and thread of the functions [`timed`] wraps (probes)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def timed(self, name: str, fn: Any) -> Any:
        """``fn``, its calls' wall time added to phase ``name``."""
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                with self._lock:
                    self[name] = self.get(name, 0.0) + time.perf_counter() - t
        return wrapper


SMALL_PROMPT = 16  # tokens: two such prompts make a step of 32 tokens, top-8 of 128 experts at 16 slots "naive"


def _one_token(params: Any) -> Any:
    one = params.clone()
    one.max_tokens = 1
    return one


def answer_engine_command(conn: Any, llm: Any, cmd: str, lora_request: Any, prompts: Any, params: Any,
                          plp: Any) -> None:
    """One engine process's answer to the driver (``run``: seconds to decode ``prompts``; ``activate``: the same
    with one output token, which makes the requests' adapters active in their slots; ``logprobs``: each prompt's
    logprobs; ``small_logprobs``: the same for each prompt's first `SMALL_PROMPT` tokens, two prompts a step, batches
    of at most 32 tokens, which vLLM 0.26-0.33 gives the fused-MoE LoRA "naive" assignment that a decode batch gets,
    where the plugin's pair kernels run), the protocol the decode benches' engines share."""
    if cmd in ("run", "activate"):  # activate: one token each, which puts the requests' adapters in slots
        t = time.perf_counter()
        llm.generate(prompts, params if cmd == "run" else _one_token(params), lora_request=lora_request,
                     use_tqdm=False)
        conn.send(time.perf_counter() - t)
    elif cmd == "logprobs":
        conn.send(_prompt_logprobs(llm.generate(prompts, plp, lora_request=lora_request, use_tqdm=False)))
    elif cmd == "small_logprobs":
        rows = []
        for i in range(0, len(prompts), 2):
            short = [{**p, "prompt_token_ids": p["prompt_token_ids"][:SMALL_PROMPT]} for p in prompts[i:i + 2]]
            loras = lora_request[i:i + 2] if isinstance(lora_request, list) else lora_request
            rows += _prompt_logprobs(llm.generate(short, plp, lora_request=loras, use_tqdm=False))
        conn.send(rows)


def _prompt_logprobs(outs: Any) -> list[list[float]]:
    """Each output's logprob of each prompt token after the first (``prompt_logprobs=0``: the token's own)."""
    return [[next(iter(pos.values())).logprob if pos else 0.0 for pos in o.prompt_logprobs[1:]] for o in outs]
