"""Build adapters in a separate process, so a build never holds the engine thread's GIL.

A background build in a worker thread shares the Python GIL with the engine thread. Its per-key
Python work (header, planning, checks) then slows every engine step: with 32 requests decoding, building a
37k-key MoE adapter in a thread leaves gaps of 0.5–0.7 s between their tokens. Here each worker starts a build
process (``python -m vllm_lora_ext.integration.build_child``) the first time it builds in the
background, and hands it a `BuildJob`: the model as plain data and vLLM's key mapper. The process
runs `vllm_lora_ext.building.build_adapter` (resolve, read, plan, check, pack), with per-expert
factors stacked straight into one shared-memory file, and answers with its manifest; the worker maps
that file, so the tensors are not copied again. While idle, the process keeps one spare file with its
pages already taken (``VLLM_LORA_EXT_BUILD_SPARE_BYTES``, default 2 GiB, growing with the adapters built
up to twice that), so that a build's writes do not allocate a page per 4 KiB. A process takes 15-20 s to start
(it imports vLLM's key parser); builds asked for meanwhile run in the worker thread rather than wait, and are then
planned ahead in the process, in the order built (their headers parsed and plans made, no tensor read), so that
the next adapter of the same shape (one trained the same way: byte-equal headers) takes the kept header and plan,
as a build after one of its shape does (``building.plan_ahead``; 0.1-0.2 s at 48 layers).

The protocol is pickle over the process's stdin/stdout; it is private to the worker and its child.
The process exits when the worker closes its stdin (or dies). Errors come back as the plugin's own
typed errors. Each worker has one build process, which runs up to four builds at once (a mix's
components, adapters asked for together): jobs carry a number and answers come back in any order.
A process that dies fails the builds it had in flight; the next build starts a new one.
``VLLM_LORA_EXT_BUILD_PROCESS=0`` builds in a worker thread instead. Where this sits in an adapter's life
(steps 3 and 4): see ``transport``.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

from vllm_lora_ext._util import clip
from vllm_lora_ext.building import BuildJob, BuiltAdapter
from vllm_lora_ext.constants import ENV_BUILD_DIR, build_dir
from vllm_lora_ext.errors import BuildProcessError, VllmLoraExtError, rebuild_error
from vllm_lora_ext.integration.build_child import AHEAD
from vllm_lora_ext.sharedfiles import folder_problem
from vllm_lora_ext.transport.handover import SharedTensors, from_shared

logger = logging.getLogger(__name__)

__all__ = ["build_dir_usable", "build_elsewhere", "plan_ahead", "prestart", "shutdown"]

_START_TIMEOUT_S = 300.0
_CHILD = "vllm_lora_ext.integration.build_child"  # the process's side, run as a module
_MAX_AHEAD = 8  # jobs kept to plan ahead while the process starts (a server's adapters named at its start)


class _Child:
    """One build process, its pipes, and the builds it has in flight.

    Several builds may be in flight at once (the components of a mix, two adapters asked for together):
    each job carries a number, the process builds jobs on a few threads of its own, and one reader
    thread here hands each answer to the caller waiting for that number.
    """

    def __init__(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # what this process imports, the child does
        self.proc = subprocess.Popen([sys.executable, "-m", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, close_fds=True)
        _widen_pipe(self.proc.stdin)
        self.started = time.monotonic()
        logger.info("starting a build process (pid %d, asked for on thread %r)", self.proc.pid,
                    threading.current_thread().name)
        self._ready = threading.Event()
        self._ready_logged = False
        self.ready_after = float("nan")
        self._lock = threading.Lock()  # guards the pipe's writes, the job numbers and the pending map
        self._pending: dict[int, Future[SharedTensors]] = {}
        self._next = 0
        self._gone: BuildProcessError | None = None
        self._ahead: list[tuple[BuildJob, Any, Any]] = []  # jobs to plan ahead once started, oldest first
        threading.Thread(target=self._read_answers, name=f"vllm-lora-ext-build-{self.proc.pid}",
                         daemon=True).start()

    @property
    def alive(self) -> bool:
        return self._gone is None and self.proc.poll() is None

    def _read_answers(self) -> None:
        out = self.proc.stdout
        assert out is not None
        try:
            while True:
                message = pickle.load(out)
                if message[0] == "ready":
                    self.ready_after = time.monotonic() - self.started  # logged by the first caller to see it
                    self._ready.set()
                    self._send_ahead()
                    continue
                tag, number, payload = message
                if tag == "planned":
                    _log_planned(*payload)
                    continue
                with self._lock:
                    future = self._pending.pop(number, None)
                if future is None:
                    continue
                if tag == "ok":
                    future.set_result(payload)
                else:
                    future.set_exception(rebuild_error(payload))
        except Exception as err:  # its end (EOF) or anything unreadable: every build in flight fails, none hangs
            try:
                code = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # alive but not answering readably: it cannot be used
                self.proc.kill()
                code = self.proc.wait()
            self._fail(BuildProcessError(f"the build process (pid {self.proc.pid}) exited (code {code}); its "
                                         f"output is in the worker's log"), cause=err)

    def _fail(self, error: BuildProcessError, *, cause: BaseException | None = None) -> None:
        error.__cause__ = cause
        with self._lock:
            self._gone = self._gone or error
            pending, self._pending = self._pending, {}
        self._ready.set()  # wakes anyone waiting for the start; they see it gone
        for future in pending.values():
            future.set_exception(error)

    def check_ready(self) -> bool:
        """Whether it has finished starting and is alive (never blocks)."""
        ready = self._ready.is_set() and self.alive
        if ready:
            self._log_ready()
        return ready

    def wait_ready(self) -> None:
        if not self._ready.wait(_START_TIMEOUT_S):
            raise BuildProcessError(f"the build process (pid {self.proc.pid}) did not start within "
                                    f"{_START_TIMEOUT_S:.0f} s")
        if self._gone is not None:
            raise self._gone
        self._log_ready()

    def _log_ready(self) -> None:
        if not self._ready_logged:
            self._ready_logged = True
            logger.info("build process %d ready after %.1f s", self.proc.pid, self.ready_after)

    def submit(self, job: BuildJob, mapper: Any, skip_prefixes: Any) -> Future[SharedTensors]:
        """Send ``job``; the future gives its shared tensors or raises its error."""
        self.wait_ready()
        future: Future[SharedTensors] = Future()
        with self._lock:
            if self._gone is not None:
                raise self._gone
            number, self._next = self._next, self._next + 1
            self._pending[number] = future
            try:
                self._write((number, job, mapper, skip_prefixes, time.time()))  # the send time: the pipe's delay
            except BuildProcessError:
                self._pending.pop(number, None)
                raise
        return future

    def _write(self, message: tuple[Any, ...]) -> None:  # under the lock
        # Pickled whole first, then written in as few writes as the pipe takes: each write to a full pipe gives the
        # GIL away, and a busy engine thread keeps it up to 5 ms each time.
        stdin = self.proc.stdin
        assert stdin is not None
        try:
            stdin.write(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
            stdin.flush()
        except (OSError, ValueError) as err:
            raise BuildProcessError(f"the build process (pid {self.proc.pid}) is gone (code "
                                    f"{self.proc.poll()})") from err

    def plan_ahead(self, job: BuildJob, mapper: Any, skip_prefixes: Any) -> None:
        """Have the process plan ``job``'s adapter once it has started, after those asked for before it (the last
        ``_MAX_AHEAD``); it answers with a "planned" record each, logged."""
        with self._lock:
            self._ahead = [*(a for a in self._ahead if a[0].path != job.path), (job, mapper, skip_prefixes)]
            del self._ahead[:-_MAX_AHEAD]
        if self._ready.is_set():  # (started meanwhile: the reader has sent what it found, or sends this now)
            self._send_ahead()

    def _send_ahead(self) -> None:
        with self._lock:
            ahead, self._ahead = self._ahead, []
            if not ahead or self._gone is not None:
                return
            try:  # one message: planned one after another in this order, so the last one's plan is the one kept
                self._write((AHEAD, ahead, None, None, time.time()))
            except Exception as err:  # a speed-up only (on the reader's thread: never let it end the process)
                logger.debug("no plan ahead: %s: %s", type(err).__name__, err)

    def run(self, job: BuildJob, mapper: Any, skip_prefixes: Any) -> SharedTensors:
        return self.submit(job, mapper, skip_prefixes).result()

    def close(self, *, wait: float | None = None) -> None:
        """Close its stdin (it exits on its own once its builds are done); with ``wait``, kill it if it has not
        exited by then."""
        with self._lock:
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


def _widen_pipe(pipe: Any) -> None:
    """Let a pipe hold a whole job (a large model's description is about 1 MB) where Linux allows it."""
    try:
        import fcntl

        fcntl.fcntl(pipe.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (ImportError, OSError, AttributeError, ValueError):
        pass  # another OS, or above /proc/sys/fs/pipe-max-size: the default size works, in more writes


class _Pool:
    """The worker's one build process: started on first need, replaced when it dies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child: _Child | None = None

    def _current(self) -> _Child:  # under the lock
        if self._child is None or not self._child.alive:
            if self._child is not None:
                self._child.close()
            self._child = _Child()
        return self._child

    def get(self) -> _Child:
        """The build process, started (and waited for) if need be."""
        with self._lock:
            child = self._current()
        child.wait_ready()
        return child

    def get_started(self) -> _Child | None:
        """The build process if it has finished starting, else ``None`` (one is then starting)."""
        with self._lock:
            child = self._current()
        return child if child.check_ready() else None

    def plan_ahead(self, job: BuildJob, mapper: Any, skip_prefixes: Any) -> None:
        """Have the process that is starting plan ``job`` once started; nothing if none is starting."""
        with self._lock:
            child = self._child
        if child is not None and child.alive and not child.check_ready():
            child.plan_ahead(job, mapper, skip_prefixes)

    def prestart(self) -> None:
        with self._lock:
            self._current()

    def shutdown(self) -> None:
        with self._lock:
            child, self._child = self._child, None
        if child is not None:
            child.close(wait=5.0)


_POOL = _Pool()
atexit.register(_POOL.shutdown)


_DIR_CHECKED: dict[str, bool] = {}


def build_dir_usable() -> bool:
    """Whether ``VLLM_LORA_EXT_BUILD_DIR``, if set, can hold a build process's files; if not, warn once for that value.

    A folder that is missing, a file or read-only would fail every background build: builds then run in the
    worker (as with ``VLLM_LORA_EXT_BUILD_PROCESS=0``) instead.
    """
    configured = build_dir()
    if not configured:
        return True
    with _CHECK_LOCK:
        usable = _DIR_CHECKED.get(configured)
        if usable is None:
            problem = folder_problem(configured)
            usable = _DIR_CHECKED[configured] = problem is None
            if problem is not None:
                logger.warning("%s=%r %s: background builds run in the worker instead of a build process. Point %s "
                               "at a writable folder (e.g. /dev/shm) or unset it.", ENV_BUILD_DIR, clip(configured),
                               problem, ENV_BUILD_DIR)
    return usable


_CHECK_LOCK = threading.Lock()


def prestart() -> None:
    """Start the build process now (it takes about 15 s to import), so that it is ready for the builds to come."""
    _POOL.prestart()


def shutdown() -> None:
    """Stop this worker's build process (it also exits with the worker)."""
    _POOL.shutdown()


def build_elsewhere(job: BuildJob, router: Any, *, wait_for_start: bool = True) -> tuple[BuiltAdapter, Any] | None:
    """Build ``job`` in the build process; return the adapter (tensors mapped from shared memory) and the mapping.

    Calls from several threads build at the same time in the one process. The process takes about 15 s
    to start (it imports vLLM's key parser). With ``wait_for_start=False`` this returns ``None`` at once
    while it starts, and the caller builds where it is (then [`plan_ahead`]); later builds find it started.

    A build whose shared file could not be made or mapped (the folder was removed or is full) also returns
    ``None``, with one warning, and the caller builds where it is.

    Raises:
        The build's own error ([`AdapterNotFoundError`], [`AdapterFormatError`], ...), or
        [`BuildProcessError`] if the process could not start or died (the next build starts a new one).
    """
    child = _POOL.get() if wait_for_start else _POOL.get_started()
    if child is None:
        return None
    t0 = time.perf_counter()
    try:
        shared = child.run(job, router.mapper, router.skip_prefixes)
        t1 = time.perf_counter()
        found = from_shared(shared)
    except OSError as err:
        if isinstance(err, VllmLoraExtError):  # the adapter's own error (not found, download): the request's answer
            raise
        _warn_hand_over(job.name, err)  # the shared folder failed (removed, full): the caller builds here instead
        return None
    logger.info("adapter %r: the build process answered %.2f s after the job was sent (its pickling included); "
                "mapped in %.3f s", job.name, t1 - t0, time.perf_counter() - t1)
    return found


def plan_ahead(job: BuildJob, router: Any) -> None:
    """Have the build process that is still starting plan ``job`` ahead once started (``building.plan_ahead``): call
    it after the worker built ``job`` itself, so that the files are there and the job is known to build. Nothing if
    no process is starting."""
    _POOL.plan_ahead(job, router.mapper, router.skip_prefixes)


def _log_planned(name: str, seconds: float, kept: bool, refusal: str | None) -> None:
    if refusal is not None:  # (its build in this worker answered for it already)
        logger.info("adapter %r: the build process did not plan it ahead (%s)", name, refusal)
    else:
        logger.info("adapter %r: the build process planned it ahead in %.2f s%s, for the next adapter of its shape",
                    name, seconds, " (kept already)" if kept else "")


_HAND_OVER_WARNED = threading.Event()


def _warn_hand_over(name: str, err: OSError) -> None:
    log = logger.debug if _HAND_OVER_WARNED.is_set() else logger.warning
    _HAND_OVER_WARNED.set()
    log("adapter %r: the build process could not hand it over (%s: %s); it is built in the worker instead. Check "
        "that %s (or /dev/shm) exists, is writable and has room.", name, type(err).__name__, err, ENV_BUILD_DIR)
