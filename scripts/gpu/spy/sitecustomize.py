"""A launch spy for GPU diagnostics: with ``PYTHONPATH=scripts/gpu/spy:$PYTHONPATH SPY_DIR=<folder>``, every process
(vLLM's engine core included) logs each launch of vLLM's fused-MoE LoRA one-shot and small-batch kernels to
``<folder>/spy-<pid>.jsonl``: the grid, and each argument as Triton sees it for its compile key (integers with their
divisibility by 16 and whether they are 1, tensors with shape, strides, dtype and alignment, constexprs). A driver
marks phases with ``llm.collective_rpc(sitecustomize.set_phase, args=("requests",))`` (the worker comes first;
needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``). r43 found the warm-up's missed variants with it
(scripts/gpu/README.md). A diagnostic, never imported by the package."""
import importlib.abc
import importlib.machinery
import json
import os
import sys

PHASE = ["start"]
TARGET = "vllm.lora.ops.triton_ops.fused_moe_lora_op"
SPIED = ("_fused_moe_lora_one_shot_kernel", "_fused_moe_lora_small_batch_kernel")


def set_phase(worker, name):
    PHASE[0] = name
    return os.getpid()


def _desc(a):
    if isinstance(a, bool) or a is None:
        return a
    if isinstance(a, int):
        return ["int", a, a % 16 == 0, a == 1]
    if hasattr(a, "data_ptr"):
        return ["T", list(a.shape), list(a.stride()), str(a.dtype), a.data_ptr() % 16 == 0]
    return repr(a)[:40]


class _Spy:
    def __init__(self, name, kernel):
        self._name, self._k = name, kernel

    def __getitem__(self, grid):
        launch = self._k[grid]

        def run(*args, **kw):
            rec = {"k": self._name, "phase": PHASE[0], "grid": [int(g) for g in grid] if isinstance(grid, tuple) else "fn",
                   "args": [_desc(a) for a in args], "kw": {k: _desc(v) for k, v in kw.items()}}
            with open(os.path.join(os.environ.get("SPY_DIR", "/tmp"), f"spy-{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps(rec, default=str) + "\n")
            return launch(*args, **kw)
        return run

    def __getattr__(self, n):
        return getattr(self._k, n)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        orig = spec.loader.exec_module

        def exec_module(module):
            orig(module)
            for n in SPIED:
                if hasattr(module, n):
                    setattr(module, n, _Spy(n, getattr(module, n)))
        spec.loader.exec_module = exec_module
        return spec


import importlib.util  # noqa: E402
if os.environ.get("SPY_DIR"):
    sys.meta_path.insert(0, _Finder())
