"""Run several groups of GPU tests (or bench commands) at once on one lent GPU, and pack what they wrote.

A lent machine's device time is the budget, and most GPU tests spend it starting small engines that use a
fraction of the card: groups that fit side by side run side by side. Each group gets its own results file and
serve-log folder (the tests' ``record`` fixture and ``vllm_serve`` write there), so nothing is written twice.

    python3 scripts/gpu/parallel.py --out $OUT --timeout 560 \\
        "tests/gpu/test_mla.py" "tests/gpu/test_verify.py tests/gpu/test_moe_warmup.py" \\
        "bench: bench/moe_matrix.py --parallel 3 --out {out}/moe_matrix.json"

Engine-heavy groups do not share a card well: vLLM 0.26 stops an engine's start with "Error in memory profiling"
when any other process frees GPU memory while it profiles (tests freeing HF models, engines shutting down). On an
H200, ten groups side by side lost most engine starts that way, and a file lock over engine starts did not help;
two or three light groups (bench commands with small engines) have worked. Run test files one pytest at a time
when their results matter.

A group is a space-separated list of test files (run by one pytest), or ``bench:`` and a command (``{out}`` is the
group's folder). On a machine of several GPUs, ``--gpus N`` gives group i the GPU i mod N
(``CUDA_VISIBLE_DEVICES``), and the groups of one GPU run one after another, not side by side: one lane per GPU,
which keeps each engine start alone on its card. ``$OUT`` receives two files whatever the number of groups (a lent machine returns at most 8):
``logs.tgz`` (each group's log and serve logs) and ``results.tgz`` (every JSON a group wrote); the call's output
ends with the lines of each group's log that say what passed, failed or was refused. Run it after ``scripts/gpu/run.sh`` has set the machine up (``run.sh bench scripts/gpu/parallel.py``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path


def _command(group: str, out: Path) -> list[str]:
    if group.startswith("bench:"):
        return [sys.executable, *shlex.split(group[len("bench:"):].replace("{out}", str(out)))]
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=-ra", "--import-mode=importlib",
            *group.split()]


def _worth(line: str) -> bool:
    return any(w in line for w in ("passed", "failed", "FAILED", "ERROR", "Error", "error:", "verified", "WRONG",
                                   "refused", "not buildable", "wrote"))


def _start(i: int, group: str, work: Path, gpu: int | None) -> tuple[subprocess.Popen, object]:
    folder = work / f"g{i}"
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", LORA_EXT_GPU_RESULTS=str(folder / "results.json"),
               LORA_EXT_GPU_SERVE_LOG=str(folder / "serve.log"))
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    log = (folder / "group.log").open("w")
    log.write(f"$ {group}  (GPU {gpu if gpu is not None else 'all'}, started {time.strftime('%H:%M:%S')})\n")
    log.flush()
    return subprocess.Popen(_command(group, folder), stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True), log


def _finish(proc: subprocess.Popen, log, deadline: float) -> object:
    try:
        rc = proc.wait(max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        rc = "timed out"
    log.write(f"[exit {rc} at {time.strftime('%H:%M:%S')}]\n")
    log.close()
    return rc


def _lanes(groups: list[str], work: Path, gpus: int, deadline: float) -> dict[int, object]:
    """Each GPU's groups one after another; the GPUs' lanes side by side (threads)."""
    import threading
    codes: dict[int, object] = {}

    def lane(gpu: int) -> None:
        for i in range(gpu, len(groups), gpus):
            if time.time() >= deadline:
                codes[i] = "not started"
                continue
            proc, log = _start(i, groups[i], work, gpu)
            codes[i] = _finish(proc, log, deadline)

    threads = [threading.Thread(target=lane, args=(g,)) for g in range(gpus)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes


LEFT_OUT: list[str] = []  # logs over the size limit, named in the call's output instead


def _small(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    """Logs only: no JSON (the other archive), no adapter or model files a bench left in its folder."""
    if info.isfile() and info.name.endswith((".json", ".safetensors", ".bin", ".pt")):
        return None
    if info.isfile() and info.size > 8 << 20:
        LEFT_OUT.append(f"{info.name} ({info.size >> 20} MiB)")
        return None
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("groups", nargs="+")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    ap.add_argument("--timeout", type=float, default=560)
    ap.add_argument("--stagger", type=float, default=20, help="seconds between group starts (engine profiling)")
    ap.add_argument("--gpus", type=int, default=0, help="one lane of groups per GPU (0: all groups side by side)")
    args = ap.parse_args()
    work = Path("/tmp/parallel-groups")
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.timeout
    if args.gpus:
        codes = _lanes(args.groups, work, args.gpus, deadline)
    else:
        started = []
        for i, group in enumerate(args.groups):
            started.append(_start(i, group, work, None))
            if i + 1 < len(args.groups):
                time.sleep(args.stagger)
        codes = {i: _finish(proc, log, deadline) for i, (proc, log) in enumerate(started)}
    status = 0
    for i, group in enumerate(args.groups):
        print(f"[{codes.get(i)}] {group}")
        status = status or (codes.get(i) != 0)
    for i in range(len(args.groups)):  # the end of each group's log, in the call's own output
        log = work / f"g{i}" / "group.log"
        text = log.read_text(errors="replace").splitlines() if log.exists() else []
        print(f"---- g{i}: " + "\n".join(line for line in text[-400:] if _worth(line))[-3000:])
    # Few files come back from a lent machine: every log in one archive, every JSON result in another.
    with tarfile.open(args.out / "logs.tgz", "w:gz") as tar:
        tar.add(str(work), arcname="groups", filter=_small)
    if LEFT_OUT:
        print("left out of logs.tgz (over 8 MiB): " + ", ".join(LEFT_OUT))
    with tarfile.open(args.out / "results.tgz", "w:gz") as tar:
        for f in sorted(work.rglob("*.json")):
            if f.stat().st_size <= 8 << 20:
                tar.add(str(f), arcname=str(f.relative_to(work)))
    return int(bool(status))


if __name__ == "__main__":
    sys.exit(main())
