"""Start `vllm serve` for a GPU test, wait until it is healthy, and always stop it (log kept for the results); POST JSON
to its routes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post_json(base: str, route: str, body: dict[str, Any]) -> tuple[int, str]:
    """POST ``body`` as JSON to ``{base}/v1/{route}``: the status and the answer's text (an HTTP error's too)."""
    req = urllib.request.Request(f"{base}/v1/{route}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as err:
        return int(err.code), err.read().decode()


@contextmanager
def vllm_serve(model: Path | str, args: Sequence[str], *, env: dict[str, str], log_path: Path,
               keep_log_as: str = "serve.log", timeout: float = 400) -> Iterator[dict[str, Any]]:
    """Yield ``{"base": url, "proc": Popen}`` for a healthy ``vllm serve MODEL ARGS --port P``."""
    port = free_port()
    log = log_path.open("w")
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), *args, "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if proc.poll() is not None:
                raise AssertionError("vllm serve exited:\n" + log_path.read_text()[-4000:])
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        else:
            raise AssertionError("vllm serve did not become healthy")
        yield {"base": base, "proc": proc}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        out = os.environ.get("VLLM_LORA_EXT_SERVE_LOG")
        if out:
            Path(out).with_name(keep_log_as).write_text(log_path.read_text()[-300000:])
