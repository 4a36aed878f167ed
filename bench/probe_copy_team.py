"""Probe the CPU half of GPU staging on this host: chunked copies out of a shared mapping, by OpenMP team size,
beside busy processes (issue 39 item 4; CPU only).

``transport.staging._copy_through_pinned`` fills a pinned chunk of 32 MiB at a time from the hand-over's mapping,
each fill one parallel copy on the staging thread's OpenMP team. Until r35 that team was torch's default, every
core; since r35 it is ``pools.copy_threads`` (half the cores). This times the same fills, without a GPU: ``--mib``
of a ``/dev/shm`` file a child process wrote, copied 32 MiB at a time into a plain buffer on each team size of
``--teams`` (0: ``copy_threads``), with ``--busy`` processes spinning on a core each meanwhile (the engine thread,
the API server, the build process). Every mapping is fresh, as the worker's is: its page faults are part of the
copy. Teams are interleaved rep by rep; the table gives medians. No stock counterpart: stock vLLM has no hand-over.

Usage: python bench/probe_copy_team.py [--mib 1584] [--reps 3] [--teams 0,16,8,4,1] [--busy 0,1,3] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, print_table, write_json  # noqa: E402

_CHUNK = 32 << 20


def _fills(path: str, nbytes: int, team: int) -> float:
    import torch

    from vllm_lora_ext.transport.pools import intra_op_threads

    src = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)  # a fresh mapping: no page mapped
    dst = torch.empty(_CHUNK, dtype=torch.uint8)
    dst.fill_(0)
    with intra_op_threads(team):
        t0 = time.perf_counter()
        for i in range(0, nbytes, _CHUNK):
            n = min(_CHUNK, nbytes - i)
            dst[:n].copy_(src[i:i + n])
        seconds = time.perf_counter() - t0
    assert int(dst[0]) == int(src[nbytes - (nbytes - 1) % _CHUNK - 1])  # the last chunk's first byte
    return seconds


def main() -> None:
    import torch

    from vllm_lora_ext._util import usable_cores
    from vllm_lora_ext.transport.pools import copy_threads

    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1584)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--teams", default="0,16,8,4,1", help="OpenMP team sizes (0: pools.copy_threads)")
    ap.add_argument("--busy", default="0,1,3", help="spinning processes, one setting after another")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cores = usable_cores()
    rule = copy_threads(cores)
    teams = list(dict.fromkeys(int(t) or rule for t in args.teams.split(",") if int(t) <= cores))
    nbytes = args.mib << 20
    times: dict[str, list[float]] = {}
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        path = os.path.join(tmp, "handover")
        code = ("import sys,torch; t=torch.from_file(sys.argv[1], shared=True, size=int(sys.argv[2]), "
                "dtype=torch.uint8); t.view(-1, 1 << 20).copy_(torch.arange(1 << 20).remainder_(251))")
        subprocess.run([sys.executable, "-c", code, path, str(nbytes)], check=True)
        for busy in (int(b) for b in args.busy.split(",")):
            spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
            try:
                time.sleep(0.2)
                _fills(path, nbytes, teams[0])  # warm-up
                for _ in range(args.reps):
                    for team in teams:
                        times.setdefault(f"busy {busy}, team {team}", []).append(_fills(path, nbytes, team))
            finally:
                for p in spinners:
                    p.kill()
    rows = [[case, f"{median(t):.4f}", f"{args.mib / 1024 / median(t):.1f}"] for case, t in times.items()]
    print_table(rows, ["case", "median s", "GiB/s"])
    write_json("probe_copy_team", {"mib": args.mib, "reps": args.reps, "cores": cores, "copy_threads": rule,
                                   "torch_threads": torch.get_num_threads(), "seconds": times,
                                   "median_s": {c: median(t) for c, t in times.items()}}, args.out)


if __name__ == "__main__":
    main()
