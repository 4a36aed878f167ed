"""Build adapters in a separate process, so a build never holds the engine thread's GIL.

A background build in a worker thread shares the Python GIL with the engine thread. Its per-key
Python work (header, planning, checks) then slows every engine step: on an H200, with 32 requests
decoding, gaps of 0.5–0.7 s while a 37k-key MoE adapter was built. Here each worker starts a build
process (``python -m vllm_lora_ext.integration.build_process``) the first time it builds in the
background, and hands it a `BuildJob`: the model as plain data and vLLM's key mapper. The process
runs `vllm_lora_ext.building.build_adapter` (resolve, read, plan, check, pack), with per-expert
factors stacked straight into one shared-memory file, and answers with its manifest; the worker maps
that file, so the tensors are not copied again. A process takes about 15 s to start (it imports
vLLM's key parser); builds asked for meanwhile run in the worker thread rather than wait.

The protocol is pickle over the process's stdin/stdout; it is private to the worker and its child.
The process exits when the worker closes its stdin (or dies). Errors come back as the plugin's own
typed errors. A process that dies mid-build fails that build only; the next build starts a new one.
Processes, at most ``VLLM_LORA_EXT_PREBUILD_BUILDS`` of them, are started as builds need them and
kept. ``VLLM_LORA_EXT_BUILD_PROCESS=0`` builds in a worker thread instead.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import select
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, BinaryIO

from vllm_lora_ext.building import (BuildJob, BuiltAdapter, SharedTensors, build_adapter, from_shared, shared_dir,
                                   sweep_stale, to_shared)
from vllm_lora_ext.constants import ENV_BUILD_DIR
from vllm_lora_ext.errors import BuildProcessError, VllmLoraExtError

logger = logging.getLogger("vllm_lora_ext.integration.build_process")  # also when run as __main__

__all__ = ["build_elsewhere", "prestart", "shutdown"]

_START_TIMEOUT_S = 300.0
_NICE = 5  # below the engine's priority: on a busy host the engine thread gets the core first


class _Child:
    """One build process and its pipes."""

    def __init__(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # what this process imports, the child does
        self.proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, close_fds=True)
        self.started = time.monotonic()
        self.ready = False

    def _receive(self, timeout: float | None) -> Any:
        out = self.proc.stdout
        assert out is not None
        if timeout is not None:
            readable, _, _ = select.select([out], [], [], timeout)
            if not readable:
                raise BuildProcessError(f"the build process (pid {self.proc.pid}) did not start within {timeout:.0f} s")
        try:
            return pickle.load(out)
        except (EOFError, pickle.UnpicklingError, OSError) as err:
            code = self.proc.poll()
            raise BuildProcessError(f"the build process (pid {self.proc.pid}) exited (code {code}); its output is in "
                                    f"the worker's log") from err

    def wait_ready(self) -> None:
        if not self.ready:
            tag, _ = self._receive(_START_TIMEOUT_S)
            if tag != "ready":
                raise BuildProcessError(f"the build process sent {tag!r} before it was ready")
            self.ready = True
            logger.info("build process %d ready after %.1f s", self.proc.pid, time.monotonic() - self.started)

    def check_ready(self) -> bool:
        """Whether it has finished starting (never blocks)."""
        if self.ready:
            return True
        if self.proc.poll() is not None or self.proc.stdout is None:
            return False
        readable, _, _ = select.select([self.proc.stdout], [], [], 0)
        if readable:
            self.wait_ready()
        return self.ready

    def run(self, job: BuildJob, mapper: Any, skip_prefixes: Any) -> SharedTensors:
        self.wait_ready()
        stdin = self.proc.stdin
        assert stdin is not None
        try:
            pickle.dump((job, mapper, skip_prefixes), stdin, protocol=pickle.HIGHEST_PROTOCOL)
            stdin.flush()
        except OSError as err:
            raise BuildProcessError(f"the build process (pid {self.proc.pid}) is gone (code {self.proc.poll()})") \
                from err
        tag, payload = self._receive(None)
        if tag == "ok":
            return payload  # type: ignore[no-any-return]
        raise pickle.loads(payload)

    def close(self, *, wait: float | None = None) -> None:
        """Close its stdin (it exits on its own); with ``wait``, kill it if it has not exited by then."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        if wait is not None:
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class _Pool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[_Child] = []
        self._all: list[_Child] = []

    def _start(self, *, idle: bool) -> _Child:  # under the lock
        child = _Child()
        self._all.append(child)
        if idle:
            self._idle.append(child)
        return child

    def _drop_dead(self) -> None:  # under the lock
        for child in [c for c in self._idle if c.proc.poll() is not None]:
            self._idle.remove(child)
            self._all.remove(child)

    def acquire(self) -> _Child:
        with self._lock:
            self._drop_dead()
            return self._idle.pop() if self._idle else self._start(idle=False)

    def acquire_started(self) -> _Child | None:
        """An idle process that has finished starting, or ``None`` (then one is starting: a new one if all are busy)."""
        with self._lock:
            self._drop_dead()
            for child in self._idle:
                if child.check_ready():
                    self._idle.remove(child)
                    return child
            if not self._idle:  # every process is busy: start one more for the builds to come
                self._start(idle=True)
            return None

    def release(self, child: _Child, *, ok: bool) -> None:
        with self._lock:
            if ok and child.proc.poll() is None:
                self._idle.append(child)
                return
            if child in self._all:
                self._all.remove(child)
        child.close()

    def prestart(self) -> None:
        with self._lock:
            if not self._all:
                self._start(idle=True)

    def shutdown(self) -> None:
        with self._lock:
            children, self._all, self._idle = self._all, [], []
        for child in children:
            child.close(wait=5.0)


_POOL = _Pool()
atexit.register(_POOL.shutdown)


def prestart() -> None:
    """Start one build process now (it takes about 15 s to import), so that it is ready for the builds to come."""
    _POOL.prestart()


def shutdown() -> None:
    """Stop every build process of this worker (they also exit with it)."""
    _POOL.shutdown()


def build_elsewhere(job: BuildJob, router: Any, *, wait_for_start: bool = True) -> tuple[BuiltAdapter, Any] | None:
    """Build ``job`` in a build process; return the adapter (tensors mapped from shared memory) and the mapping.

    A process takes about 15 s to start (it imports vLLM's key parser). With ``wait_for_start=False``
    this returns ``None`` at once when no started process is free (one is then starting), and the
    caller builds where it is; later builds find it started.

    Raises:
        The build's own error ([`AdapterNotFoundError`], [`AdapterFormatError`], ...), or
        [`BuildProcessError`] if the process could not start or died.
    """
    found = _POOL.acquire() if wait_for_start else _POOL.acquire_started()
    if found is None:
        return None
    child = found
    ok = False
    try:
        shared = child.run(job, router.mapper, router.skip_prefixes)
        ok = True
    except VllmLoraExtError:
        ok = child.proc.poll() is None
        raise
    finally:
        _POOL.release(child, ok=ok)
    return from_shared(shared)


# ------------------------------------------------------------------------------------------------ the child


def _send(out: BinaryIO, message: tuple[str, Any]) -> None:
    pickle.dump(message, out, protocol=pickle.HIGHEST_PROTOCOL)
    out.flush()


def main() -> None:
    """The build process: answer jobs from stdin until it closes."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the server; the worker closing stdin ends this
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the protocol owns the real stdout; anything printed (vLLM logs to stdout) goes to stderr
    inp = os.fdopen(os.dup(0), "rb")
    try:
        os.nice(_NICE)
    except OSError:
        pass
    import torch

    torch.set_num_threads(1)  # as in vLLM's workers; the reader runs its own threads
    from vllm_lora_ext._logging import attach_handler_once
    from vllm_lora_ext._util import gc_paused
    from vllm_lora_ext.integration.loader import VllmKeyRouter

    attach_handler_once()
    VllmKeyRouter(None, None).module("base_model.model.x.lora_A.weight")  # import vLLM's parser now
    for directory in {shared_dir(0), os.environ.get(ENV_BUILD_DIR) or "/dev/shm", tempfile.gettempdir()}:
        stale = sweep_stale(directory)  # left by a worker that died between a build and its hand-over
        if stale:
            logger.warning("removed %d shared files of build processes that are gone from %s", len(stale), directory)
    _send(out, ("ready", os.getpid()))
    while True:
        try:
            job, mapper, skip_prefixes = pickle.load(inp)
        except EOFError:
            return
        try:
            t0 = time.perf_counter()
            with gc_paused():  # an MoE adapter makes ~10^5 small objects: no full-heap collections meanwhile
                built = build_adapter(job, VllmKeyRouter(mapper, skip_prefixes), shared=True)
                t1 = time.perf_counter()
                shared = to_shared(built)
                del built
            logger.info("built adapter %r in %.2f s, handed over in %.2f s (%.0f MiB)", job.name, t1 - t0,
                        time.perf_counter() - t1, shared.size / 2**20)
            _send(out, ("ok", shared))
        except BaseException as err:  # sent back typed; the process lives on
            try:
                payload = pickle.dumps(err)
                pickle.loads(payload)
            except Exception:
                payload = pickle.dumps(BuildProcessError(f"{type(err).__name__}: {err}"))
            _send(out, ("err", payload))


if __name__ == "__main__":
    main()

