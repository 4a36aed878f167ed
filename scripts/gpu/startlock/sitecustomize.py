"""GPU runs only: vLLM engines on one card start (and stop) one at a time, across every process.

``scripts/gpu/parallel.py`` runs groups of GPU tests side by side and puts this folder first on ``PYTHONPATH``
with ``GPU_RUN_ENGINE_LOCK`` set. vLLM's start-up measures free GPU memory before and after profiling its model
and stops with "Error in memory profiling" (or finds "No available memory for the cache blocks") when another
process took or freed memory meanwhile. Holding one file lock over ``EngineCore.__init__`` (model load,
profiling, KV cache, warm-up) and ``EngineCore.shutdown`` in every engine-core process removes that race without
changing what any test runs. Without the variable this file does nothing.
"""

from __future__ import annotations

import os

_LOCK = os.environ.get("GPU_RUN_ENGINE_LOCK")

if _LOCK:
    import fcntl
    import functools
    import importlib.abc
    import importlib.util
    import sys
    from typing import Any

    _TARGET = "vllm.v1.engine.core"

    _HELD = [0]  # re-entry in one process (a failing __init__ calls shutdown) must not wait for itself

    def _locked(method: Any) -> Any:
        @functools.wraps(method)
        def run(*args: Any, **kwargs: Any) -> Any:
            if _HELD[0]:
                return method(*args, **kwargs)
            with open(_LOCK, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                _HELD[0] += 1
                try:
                    return method(*args, **kwargs)
                finally:
                    _HELD[0] -= 1
                    fcntl.flock(f, fcntl.LOCK_UN)
        return run

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
            if name != _TARGET:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_wrap(module: Any) -> None:
                exec_module(module)
                cls = module.EngineCore
                cls.__init__ = _locked(cls.__init__)
                cls.shutdown = _locked(cls.shutdown)

            spec.loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _Finder())
