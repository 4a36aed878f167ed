"""Run by test_full_disk.py in a subprocess: loads, mixes and errors while the metrics folder's disk is full.

Usage: ``python full_disk_child.py TMPFS WHEN WORK`` with ``WHEN`` one of ``start`` (the disk is full before the
plugin registers), ``after-setup`` (it fills once the metrics folder exists: the case that died of SIGBUS) or
``mid-run`` (it fills after the first loads wrote their files). The metrics folder goes where it goes
without ``PROMETHEUS_MULTIPROC_DIR``: the temp dir, here ``TMPFS``. Prints one JSON line with what happened.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]


def fill(folder: str) -> None:
    """Write one file until the disk has no room left."""
    fd = os.open(os.path.join(folder, "filler"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


def _conftest() -> Any:
    """tests/integration/conftest.py as a module (pytest is not running in this child)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("integration_conftest", HERE / "conftest.py")
    assert spec is not None and spec.loader is not None
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    return conftest


def no_pin_memory() -> None:
    from factories import unpin_vllm

    unpin_vllm()


def worker_manager() -> Any:
    return _conftest().make_worker_manager()


def loads(mgr: Any, work: Path, good: Path, other: Path, round_: int) -> dict[str, str]:
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import WorkerLoRAManager

    from factories import make_dense_adapter
    from test_metrics_endpoint import server_mix_path

    load = WorkerLoRAManager._load_adapter
    out: dict[str, str] = {}
    for name, path in (("good", str(good)), ("big", str(make_dense_adapter(work / f"big{round_}", rank=32))),
                       ("gone", str(work / "nothing-here")), ("mix", server_mix_path(good, other))):
        try:
            load(mgr, LoRARequest(f"{name}{round_}", 10 * round_ + len(out) + 1, path))
            out[name] = "ok"
        except Exception as err:
            out[name] = type(err).__name__
    return out


def mixes(work: Path) -> list[Any]:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from test_metrics_endpoint import mix_serving
    from vllm_lora_ext.integration import server

    (work / "mixes").mkdir(exist_ok=True)
    serving = mix_serving(work / "mixes")

    async def scenario() -> list[Any]:
        out = []
        for weights in ([0.5, 0.5], [0.7, 0.3], [1.0, float("nan")]):
            req = CompletionRequest(prompt="hi", model="base", adapters=["style", "domain"], adapter_weights=weights)
            result = await server.route_adapters(serving, req)
            out.append(None if result is None else result.error.code)
            lora = server.routed_lora(req)
            if lora is not None:
                server.claim_lease(lora).release()
        return out

    return asyncio.run(scenario())


def main() -> None:
    tmpfs, when, work_dir = sys.argv[1:4]
    tempfile.tempdir = tmpfs  # where the metrics folder goes without PROMETHEUS_MULTIPROC_DIR
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    os.environ.pop("VLLM_LORA_EXT_METRICS_DIR", None)
    os.environ["VLLM_LORA_EXT_MAX_MIXES"] = "1"
    work = Path(work_dir)
    if when == "start":
        fill(tmpfs)
    from prometheus_client import REGISTRY, generate_latest

    from factories import make_peft_adapter, scrape, tiny_llama
    from vllm_lora_ext import metrics
    from vllm_lora_ext.integration import plugin

    plugin.register()
    no_pin_memory()
    if when == "after-setup":
        fill(tmpfs)
    mgr = worker_manager()
    good = make_peft_adapter(tiny_llama(), work / "good", targets=["q_proj", "v_proj"], rank=8, alpha=16)
    other = make_peft_adapter(tiny_llama(), work / "other", targets=["q_proj"], rank=4, alpha=8)
    first = loads(mgr, work, good, other, 1)
    if when == "mid-run":
        fill(tmpfs)
    second = loads(mgr, work, good, other, 2)
    routed = mixes(work)
    got = scrape(generate_latest(REGISTRY).decode())
    wanted = {"loads_ok": ("vllm_lora_ext_adapter_loads_total", (("kind", "adapter"), ("outcome", "ok"))),
              "mixes_registered": ("vllm_lora_ext_mixes_registered_total", ()),
              "mix_errors": ("vllm_lora_ext_errors_total", (("type", "MixError"), ("where", "server")))}
    print(json.dumps({"first": first, "second": second, "routed": routed, "health": metrics.health(),
                      "metrics_dir": metrics.metrics_dir(),
                      "samples": {k: got.get(v) for k, v in wanted.items()}}), flush=True)


if __name__ == "__main__":
    main()
