"""Start `vllm serve` for a GPU test, wait until it is healthy, and always stop it (log kept for the results).

Also: the tiny model, adapters and deployment config a test serves, JSON POSTs to the server's routes, and the HTTP
library the openai client is built on."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tiny import build_adapters, build_dense


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dense_deployment(workdir: Path, tag: str, weights: Mapping[str, float | None], *, seed: int,
                     targets: Sequence[str]) -> tuple[Path, Path, Path]:
    """Build a tiny dense model (``{tag}-dense``), a PEFT adapter per name in ``weights`` (``{tag}-adapters/NAME``,
    seeded ``seed``, ``seed + 1``, ...) and the deployment config naming them, each with its default weight where one
    is given (``{tag}-deploy.yaml``); return the model's, the adapters' and the config's paths."""
    model = build_dense(workdir / f"{tag}-dense")
    roots = workdir / f"{tag}-adapters"
    build_adapters(model, roots, list(weights), seed=seed, targets=targets)
    entries = [f"  {n}: {{source: '{roots / n}'" + ("" if w is None else f", weight: {w}") + "}\n"
               for n, w in weights.items()]
    deploy = workdir / f"{tag}-deploy.yaml"
    deploy.write_text("adapters:\n" + "".join(entries))
    return model, roots, deploy


def http_module() -> Any:
    """The HTTP client library the installed ``openai`` client is built on: httpx2 where it is there, else httpx."""
    try:  # the openai client the bundle carries (3.57) is built on httpx2
        import httpx2 as http
    except ImportError:
        import httpx as http
    return http


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
        out = os.environ.get("LORA_EXT_GPU_SERVE_LOG")
        if out:
            Path(out).with_name(keep_log_as).write_text(log_path.read_text()[-300000:])
