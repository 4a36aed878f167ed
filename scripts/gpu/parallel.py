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
group's folder). ``$OUT`` receives two files whatever the number of groups (a lent machine returns at most 8):
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("groups", nargs="+")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    ap.add_argument("--timeout", type=float, default=560)
    ap.add_argument("--stagger", type=float, default=20, help="seconds between group starts (engine profiling)")
    args = ap.parse_args()
    work = Path("/tmp/parallel-groups")
    procs = []
    for i, group in enumerate(args.groups):
        folder = work / f"g{i}"
        folder.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_LORA_EXT_RESULTS=str(folder / "results.json"),
                   VLLM_LORA_EXT_SERVE_LOG=str(folder / "serve.log"))
        log = (folder / "group.log").open("w")
        log.write(f"$ {group}\n")
        log.flush()
        procs.append((group, subprocess.Popen(_command(group, folder), stdout=log, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True), log))
        if i + 1 < len(args.groups):
            time.sleep(args.stagger)
    deadline = time.time() + args.timeout
    status = 0
    for group, proc, log in procs:
        try:
            rc = proc.wait(max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc = "timed out"
        log.close()
        print(f"[{rc}] {group}")
        status = status or (rc != 0)
    for i in range(len(procs)):  # the end of each group's log, in the call's own output
        text = (work / f"g{i}" / "group.log").read_text(errors="replace").splitlines()
        print(f"---- g{i}: " + "\n".join(line for line in text[-400:] if _worth(line))[-3000:])
    # Few files come back from a lent machine: every log in one archive, every JSON result in another.
    with tarfile.open(args.out / "logs.tgz", "w:gz") as tar:
        tar.add(str(work), arcname="groups", filter=lambda t: None if t.name.endswith(".json") else t)
    with tarfile.open(args.out / "results.tgz", "w:gz") as tar:
        for f in sorted(work.rglob("*.json")):
            tar.add(str(f), arcname=str(f.relative_to(work)))
    return int(bool(status))


if __name__ == "__main__":
    sys.exit(main())
