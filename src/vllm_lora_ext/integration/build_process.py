"""Build adapters in a separate process, so a build never holds the engine thread's GIL.

A background build in a worker thread shares the Python GIL with the engine thread. Its per-key
Python work (header, planning, checks) then slows every engine step: with 32 requests decoding, building a
37k-key MoE adapter in a thread leaves gaps of 0.5–0.7 s between their tokens. Here each worker starts a build
process (``python -m vllm_lora_ext.integration.build_process``) the first time it builds in the
background, and hands it a `BuildJob`: the model as plain data and vLLM's key mapper. The process
runs `vllm_lora_ext.building.build_adapter` (resolve, read, plan, check, pack), with per-expert
factors stacked straight into one shared-memory file, and answers with its manifest; the worker maps
that file, so the tensors are not copied again. While idle, the process keeps one spare file with its
pages already taken (``VLLM_LORA_EXT_BUILD_SPARE_BYTES``, default 2 GiB, growing with the adapters built
up to twice that), so that a build's writes do not allocate a page per 4 KiB. A process takes 15-20 s to start
(it imports vLLM's key parser); builds asked for meanwhile run in the worker thread rather than wait.

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
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Any, BinaryIO

from vllm_lora_ext._util import clip, usable_cores
from vllm_lora_ext.building import BuildJob, BuiltAdapter, build_adapter
from vllm_lora_ext.constants import ENV_BUILD_DIR, build_dir, build_spare_bytes
from vllm_lora_ext.errors import BuildProcessError, VllmLoraExtError, error_record, rebuild_error
from vllm_lora_ext.sharedfiles import folder_problem
from vllm_lora_ext.transport.arena import ArenaSupply
from vllm_lora_ext.transport.files import sweep_stale
from vllm_lora_ext.transport.handover import SharedTensors, from_shared, to_shared, trim_shared

logger = logging.getLogger("vllm_lora_ext.integration.build_process")  # also when run as __main__

__all__ = ["build_dir_usable", "build_elsewhere", "prestart", "shutdown"]

_START_TIMEOUT_S = 300.0
_BUILD_THREADS = 4  # builds one process runs at once (a mix's components; more wait their turn)
_NICE = 5  # below the engine's priority: on a busy host the engine thread gets the core first


class _Child:
    """One build process, its pipes, and the builds it has in flight.

    Several builds may be in flight at once (the components of a mix, two adapters asked for together):
    each job carries a number, the process builds jobs on a few threads of its own, and one reader
    thread here hands each answer to the caller waiting for that number.
    """

    def __init__(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # what this process imports, the child does
        self.proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
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
                    continue
                tag, number, payload = message
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
        stdin = self.proc.stdin
        assert stdin is not None
        with self._lock:
            if self._gone is not None:
                raise self._gone
            number, self._next = self._next, self._next + 1
            self._pending[number] = future
            try:
                # Pickled whole first, then written in as few writes as the pipe takes: each write to a full
                # pipe gives the GIL away, and a busy engine thread keeps it up to 5 ms each time.
                message = (number, job, mapper, skip_prefixes, time.time())  # the send time: the pipe's delay logged
                stdin.write(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
                stdin.flush()
            except (OSError, ValueError) as err:
                self._pending.pop(number, None)
                raise BuildProcessError(f"the build process (pid {self.proc.pid}) is gone (code "
                                        f"{self.proc.poll()})") from err
        return future

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
    while it starts, and the caller builds where it is; later builds find it started.

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


_HAND_OVER_WARNED = threading.Event()


def _warn_hand_over(name: str, err: OSError) -> None:
    log = logger.debug if _HAND_OVER_WARNED.is_set() else logger.warning
    _HAND_OVER_WARNED.set()
    log("adapter %r: the build process could not hand it over (%s: %s); it is built in the worker instead. Check "
        "that %s (or /dev/shm) exists, is writable and has room.", name, type(err).__name__, err, ENV_BUILD_DIR)


# ------------------------------------------------------------------------------------------------ the child


_SEND_LOCK = threading.Lock()
_ACTIVE = [0]  # builds running in this process; the cyclic GC is off while any runs


def _send(out: BinaryIO, message: tuple[Any, ...]) -> None:
    with _SEND_LOCK:
        pickle.dump(message, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()


def _gc_hold(delta: int) -> None:
    import gc

    with _SEND_LOCK:
        _ACTIVE[0] += delta
        if _ACTIVE[0] == 1 and delta > 0:
            gc.disable()  # an MoE adapter makes ~10^5 small objects: no full-heap collections meanwhile
        elif _ACTIVE[0] == 0:
            gc.enable()


def _answer(out: BinaryIO, number: int, job: BuildJob, mapper: Any, skip_prefixes: Any, arenas: ArenaSupply,
            arrival: tuple[float, float]) -> None:
    """Build ``job`` and send its hand-over (or its error) back; ``arrival``: when it was read (``perf_counter``) and
    how long it took from the worker's pickling of it to then (the pickling, the pipe and the unpickling)."""
    from vllm_lora_ext.integration.key_router import VllmKeyRouter

    _gc_hold(+1)
    trim_fd: int | None = None
    held: list[Any] = []  # this process's views of the arena: unmapped after the answer is sent, not before
    try:
        received, in_pipe = arrival
        t0 = time.perf_counter()
        waited = t0 - received
        spares_before = arenas.taken
        held.append(build_adapter(job, VllmKeyRouter(mapper, skip_prefixes), shared=True, arenas=arenas))
        t1 = time.perf_counter()
        shared = to_shared(held[0], trim=False)
        trim_fd = os.open(shared.path, os.O_RDWR)  # the worker removes the name once it has mapped the file
        logger.info("built adapter %r in %.2f s, handed over in %.2f s (%.0f MiB; in the pipe %.2f s, queued %.2f s, "
                    "spare %s)", job.name, t1 - t0, time.perf_counter() - t1, shared.size / 2**20, in_pipe, waited,
                    "used" if arenas.taken > spares_before else "none ready")
        message: tuple[Any, ...] = ("ok", number, shared)
    except BaseException as err:  # sent back as a record of its type and fields; the process lives on
        message = ("err", number, error_record(err))
    finally:
        _gc_hold(-1)
    _send(out, message)
    after = threading.Thread(target=_after_hand_over, name="vllm-lora-ext-trim", daemon=True,
                             args=(trim_fd, shared if trim_fd is not None else None, arenas, held))
    _AFTER[:] = [*(t for t in _AFTER if t.is_alive()), after]
    after.start()


_HAND_OVER_WAIT_S = 30.0
_SETTLE_S = 0.5
_STOPPING = threading.Event()  # the worker closed the pipe: hand-overs still waiting give up
_AFTER: list[threading.Thread] = []  # their threads, joined before the process exits (they hold torch tensors)


def _after_hand_over(trim_fd: int | None, shared: SharedTensors | None, arenas: ArenaSupply, held: list[Any]) -> None:
    """Once the worker has the adapter, drop this process's views of it (``held``), cut the spare's unused tail and
    prepare the next spare.

    Not at once: cutting a file takes its inode lock while it frees the tail's pages (0.2-0.3 s for 1.8 GB),
    and the worker's ``open``/``unlink`` of the same file would wait for it, on the new adapter's critical path.
    The worker removes the file's name once it has mapped it; this waits for that (and for the worker's staging
    copy to get going) before touching the file or the memory bus. The views go first:
    unmapping a spare, whose every page is mapped (``transport.arena``), costs more than a mapping that only the
    build's writes filled, and dropped before the answer it made the hand-over 0.13 s instead of 0.04 s (H200 host,
    1.6 GB adapter, 32 requests decoding).
    """
    if shared is None or trim_fd is None:
        held.clear()
    else:
        deadline = time.monotonic() + _HAND_OVER_WAIT_S
        while os.path.exists(shared.path) and time.monotonic() < deadline and not _STOPPING.wait(0.01):
            pass
        held.clear()
        _STOPPING.wait(_SETTLE_S)
        trim_shared(trim_fd, shared)  # a spare's unused pages, freed after the worker has the adapter
    if not _STOPPING.is_set():
        arenas.prepare()  # the next spare, now that this build no longer needs the memory bandwidth


def _torch_threads() -> int:
    """Threads for torch in the build process: a quarter of the cores, from 1 to 4 (it runs beside the engine)."""
    return max(1, min(4, usable_cores() // 4))


def main() -> None:
    """The build process: build the jobs read from stdin, a few at a time, until it closes."""
    import signal
    from concurrent.futures import ThreadPoolExecutor

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the server; the worker closing stdin ends this
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the protocol owns the real stdout; anything printed (vLLM logs to stdout) goes to stderr
    inp = os.fdopen(os.dup(0), "rb")
    try:
        os.nice(_NICE)
    except OSError:
        pass
    import torch

    # A few threads for the packing copies (an engine at TP=1 gives torch every core, and on one thread a 3D
    # adapter's build takes about twice as long here as in the engine); the reader has its own.
    torch.set_num_threads(_torch_threads())
    from vllm_lora_ext._logging import attach_handler_once
    from vllm_lora_ext.integration.key_router import VllmKeyRouter

    attach_handler_once()
    VllmKeyRouter(None, None).module("base_model.model.x.lora_A.weight")  # import vLLM's parser now
    from vllm_lora_ext.integration._compat import preload_build_job_modules

    preload_build_job_modules()  # and what a job's key mapper unpickles with
    from vllm_lora_ext.formats.moe_read import read_pools
    from vllm_lora_ext.transport.pools import start_pools

    start_pools(read_pools(usable_cores()))  # the first build's read and scan threads, ready
    for directory in {build_dir() or "/dev/shm", tempfile.gettempdir()}:  # where shared_dir puts them
        stale = sweep_stale(directory)  # left by a worker that died between a build and its hand-over
        if stale:
            logger.warning("removed %d shared files of build processes that are gone from %s", len(stale), directory)
    try:
        spare = build_spare_bytes()
    except ValueError as err:  # refused at the server's start; never a reason for this process to die
        logger.warning("%s; the build process keeps no spare file", err)
        spare = 0
    arenas = ArenaSupply(spare)
    _send(out, ("ready", os.getpid()))
    arenas.prepare()  # the first spare, while no build is asked for yet
    try:
        with ThreadPoolExecutor(_BUILD_THREADS, thread_name_prefix="build") as pool:
            while True:
                try:
                    number, job, mapper, skip_prefixes, sent = pickle.load(inp)
                except EOFError:
                    return  # the pool's exit finishes the builds in flight first
                arrival = (time.perf_counter(), max(0.0, time.time() - sent))
                pool.submit(_answer, out, number, job, mapper, skip_prefixes, arenas, arrival)
    finally:
        _STOPPING.set()
        for thread in list(_AFTER):
            thread.join(10.0)
        arenas.discard()  # and waits for a spare being made


if __name__ == "__main__":
    main()
