"""A full temp dir (the metrics folder's home without PROMETHEUS_MULTIPROC_DIR) never fails or kills anything.

Each case mounts a tiny tmpfs as the temp dir of a child process (``full_disk_child.py``) that loads
adapters through vLLM's worker manager, routes mixes through the server and answers bad requests, with
the disk full at start, right after the metrics folder was made (before this fix, the first metric write
died there of SIGBUS in prometheus_client's mapping), or after the first loads. Skipped where a tmpfs
cannot be mounted (not root, or no mount permission in a container).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from factories import tiny_tmpfs

pytestmark = pytest.mark.vllm

CHILD = Path(__file__).with_name("full_disk_child.py")
HEALTHY = {"loads_ok": 4.0, "mixes_registered": 2.0, "mix_errors": 1.0}  # what a run with room records


@pytest.mark.parametrize(("when", "size"), [("start", "64k"), ("after-setup", "2m"), ("mid-run", "2m")])
def test_loads_mixes_and_errors_succeed_with_metrics_in_memory_when_the_temp_dir_is_full(
        tmp_path: Path, when: str, size: str) -> None:
    with tiny_tmpfs(size) as disk:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        done = subprocess.run([sys.executable, str(CHILD), str(disk), when, str(tmp_path)], env=env,
                              capture_output=True, text=True, timeout=600)
        left = sorted(n for n in os.listdir(disk) if not n.startswith("torchinductor"))  # torch's own cache folder
    assert done.returncode == 0, f"exit status {done.returncode} (negative: killed by a signal)\n{done.stderr[-3000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    expected = {"good": "ok", "big": "AdapterCompatibilityError", "gone": "LoRAAdapterNotFoundError", "mix": "ok"}
    assert result["first"] == result["second"] == expected  # loads and their errors as with room
    assert result["routed"] == [None, None, 400]  # two mixes routed, a NaN weight answered 400
    assert result["health"]["degraded"] and result["health"]["write_failures"] == 0
    assert result["samples"] == HEALTHY  # the API server's own samples still show on /metrics
    assert done.stderr.count("keeps its metrics in memory") == 1  # one warning, not one per write
    assert left == ["filler"]  # the metrics folder and the owner's lock file are gone at exit


_RESIDENT_CHILD = """
import os, sys, tempfile
disk, degrade_first = sys.argv[1], sys.argv[2] == "1"
os.environ["TMPDIR"] = disk
tempfile.tempdir = None
from vllm_lora_ext import metrics, resident_metric
metrics.setup()
fd = os.open(os.path.join(disk, "filler"), os.O_WRONLY | os.O_CREAT)
try:
    while True:
        os.write(fd, b"x" * 4096)
except OSError:
    pass
os.close(fd)
if degrade_first:
    metrics.MIXES_REGISTERED.inc()
print(resident_metric.write_resident({f"adapter-{i}": "gpu" for i in range(300)}, max_series=1000), flush=True)
print("alive", bool(metrics.health()["degraded"]), flush=True)
"""


@pytest.mark.parametrize("degrade_first", [True, False], ids=["after-a-failed-write", "residency-first"])
def test_the_residency_gauge_never_kills_a_process_on_a_full_disk(tmp_path: Path, degrade_first: bool) -> None:
    with tiny_tmpfs("4m") as disk:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        done = subprocess.run([sys.executable, "-c", _RESIDENT_CHILD, str(disk), "1" if degrade_first else "0"],
                              env=env, capture_output=True, text=True, timeout=300)
        left = sorted(n for n in os.listdir(disk) if n.endswith((".tmp", ".new")))
    assert done.returncode == 0, f"exit status {done.returncode} (negative: killed by a signal)\n{done.stderr[-2000:]}"
    assert done.stdout.split() == ["0", "alive", str(degrade_first)]
    assert left == []  # no half-written residency file is left behind
