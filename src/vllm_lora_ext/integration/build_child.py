"""The build process's own side (``python -m vllm_lora_ext.integration.build_child``): it reads numbered jobs from
its stdin, builds a few at a time (``building.build_adapter`` into a shared-file arena from its spare supply), and
answers each with its hand-over's manifest or its error's record on its stdout. A job numbered ``AHEAD`` is only
planned (``building.plan_ahead``) and answered with a "planned" record. The worker's side, why the process exists and
the protocol's rules: ``integration.build_process``.
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
import threading
import time
from typing import Any, BinaryIO

from vllm_lora_ext._util import clip, usable_cores
from vllm_lora_ext.building import BuildJob, build_adapter
from vllm_lora_ext.constants import build_dir, build_spare_bytes
from vllm_lora_ext.errors import error_record
from vllm_lora_ext.transport.arena import ArenaSupply
from vllm_lora_ext.transport.files import sweep_stale
from vllm_lora_ext.transport.handover import SharedTensors, to_shared, trim_shared

logger = logging.getLogger("vllm_lora_ext.integration.build_child")  # also when run as __main__

__all__ = ["AHEAD", "main"]

AHEAD = -1  # a job's number that asks for its plan ahead, not its build (answered with a "planned" record)
_BUILD_THREADS = 4  # builds one process runs at once (a mix's components; more wait their turn)
_NICE = 5  # below the engine's priority: on a busy host the engine thread gets the core first


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


def _plan_ahead(out: BinaryIO, jobs: list[tuple[BuildJob, Any, Any]]) -> None:
    """Plan each job in turn and keep its header and plan (``building.plan_ahead``: the last one's are what a
    later build finds); send a "planned" record back for each."""
    from vllm_lora_ext.building import plan_ahead
    from vllm_lora_ext.integration.key_router import VllmKeyRouter

    for job, mapper, skip_prefixes in jobs:
        t0 = time.perf_counter()
        kept, refusal = False, None
        try:
            kept = plan_ahead(job, VllmKeyRouter(mapper, skip_prefixes))
        except Exception as err:  # a speed-up only; the process lives on
            refusal = clip(f"{type(err).__name__}: {err}")
        _send(out, ("planned", AHEAD, (job.name, time.perf_counter() - t0, kept, refusal)))


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
        with ThreadPoolExecutor(_BUILD_THREADS, thread_name_prefix="build") as pool, \
                ThreadPoolExecutor(1, thread_name_prefix="plan-ahead") as ahead:
            while True:
                try:
                    number, job, mapper, skip_prefixes, sent = pickle.load(inp)
                except EOFError:
                    return  # the pool's exit finishes the builds in flight first
                if number == AHEAD:  # (``job``: the jobs to plan ahead, in order, after any sent before)
                    ahead.submit(_plan_ahead, out, job)
                    continue
                arrival = (time.perf_counter(), max(0.0, time.time() - sent))
                pool.submit(_answer, out, number, job, mapper, skip_prefixes, arenas, arrival)
    finally:
        _STOPPING.set()
        for thread in list(_AFTER):
            thread.join(10.0)
        arenas.discard()  # and waits for a spare being made


if __name__ == "__main__":
    main()
