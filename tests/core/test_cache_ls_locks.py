"""`vllm-lora cache ls` under diskholds.reading (a shared flock, read-only scans): no flock on the file system,
EACCES for a held lock, a symlink or FIFO at state.lock, a lister beside a writer."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from factories import hub_adapter_files
from vllm_lora_ext import resolve_source
from vllm_lora_ext import diskholds
from vllm_lora_ext.diskcache import list_cache


def _cache(hub: Any, tmp_path: Path) -> tuple[Path, Path]:
    hub.repo("acme/l").commit(hub_adapter_files(0))
    cache = tmp_path / "cache"
    resolve_source("hf:acme/l", cache_dir=cache)
    return cache, cache / ".locks" / "vllm_lora_ext"


def test_cache_ls_where_flock_is_missing(hub: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system without flock (Lustre mounted without -o flock answers ENOSYS): filelock falls back to its soft
    lock there, so the writers work; `cache ls` (raw fcntl.flock) must not fail where `prune` and the server work."""
    cache, root = _cache(hub, tmp_path)

    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    (root / "holds").mkdir(exist_ok=True)
    (root / "holds" / "123-x.lock").write_text("")
    (root / "holds" / "123-x.json").write_text(json.dumps({"pid": 123, "holds": []}))
    assert [r.repo_id for r in list_cache(cache_dir=cache)] == ["acme/l"]


def test_cache_ls_where_contention_reads_eacces(hub: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Some file systems answer EACCES, not EAGAIN, for a lock another holds (filelock counts both as contention):
    `cache ls` waits for the writer, and an owner lock so answered is a live owner's, not an error."""
    cache, root = _cache(hub, tmp_path)
    real = fcntl.flock
    busy = {"state": 3}

    def flock(fd: int, op: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        if op & fcntl.LOCK_NB and op & fcntl.LOCK_SH:
            if name.endswith("state.lock") and busy["state"] > 0:
                busy["state"] -= 1
                raise PermissionError(errno.EACCES, "Permission denied")
            if name.endswith("live.lock"):
                raise PermissionError(errno.EACCES, "Permission denied")
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    (root / "holds").mkdir(exist_ok=True)
    (root / "holds" / "99-live.lock").write_text("")
    (root / "holds" / "99-live.json").write_text(json.dumps({"pid": 99, "holds": [
        {"repo_id": "acme/l", "revision": None, "why": "adapter 'l' (registered)"}]}))
    revs = list_cache(cache_dir=cache)
    assert busy["state"] == 0 and revs[0].held_by == ("pid 99: adapter 'l' (registered)",), revs


def test_cache_ls_with_a_fifo_or_dir_state_lock_does_not_hang(hub: Any, tmp_path: Path) -> None:
    cache, root = _cache(hub, tmp_path)
    for make in (os.mkfifo, os.mkdir):
        (root / "state.lock").unlink() if (root / "state.lock").is_file() or (root / "state.lock").is_fifo() \
            else (root / "state.lock").rmdir() if (root / "state.lock").is_dir() else None
        make(root / "state.lock")
        t0 = time.monotonic()
        assert [r.repo_id for r in list_cache(cache_dir=cache)] == ["acme/l"]
        assert time.monotonic() - t0 < 5


def test_fetch_reports_every_source_when_its_listing_fails(hub: Any, isolated_hf_cache: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """fetch's new refusal text (`_refused_beside_own`) lists the cache inside the `except` that reports a source's
    failure: a listing that fails there (a writer holding the state lock past the timeout, an unreadable entry)
    escaped it, so the sources after it were never tried and the refusal was lost."""
    import vllm_lora_ext.cli.cache  # noqa: F401  (bound to the real list_cache before it is patched here)
    import vllm_lora_ext.diskcache as diskcache
    from vllm_lora_ext.cli import main
    from vllm_lora_ext.constants import ENV_DISK_CACHE_BYTES

    files = hub_adapter_files(0)
    rev = sum(len(v) for v in files.values())
    hub.repo("acme/f0").commit(files)
    hub.repo("acme/f1").commit(hub_adapter_files(1))
    hub.repo("acme/f2").commit(hub_adapter_files(2))
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, str(rev * 3 // 2))

    def busy(**_: Any) -> list[Any]:
        raise TimeoutError("another process holds the disk cache state")

    monkeypatch.setattr(diskcache, "list_cache", busy)
    assert main(["fetch", "hf:acme/f0", "hf:acme/f1", "hf:acme/f2"]) == 1
    out, err = capsys.readouterr()
    assert "hf:acme/f0 ->" in out and err.count("error:") == 2 and "'hf:acme/f2'" in err, (out, err)


def test_a_symlinked_state_lock_is_not_followed(hub: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writers (filelock) open state.lock with O_NOFOLLOW; `reading` and the owner probe followed a symlink planted
    there (a shared cache), to any file: one another process locks makes every `cache ls` wait out the timeout and
    fail, and the open itself reaches whatever the link names (a device node has open side effects)."""
    cache, root = _cache(hub, tmp_path)
    monkeypatch.setattr(diskholds, "_LOCK_TIMEOUT_S", 1.0)
    elsewhere = tmp_path / "someone-elses.lock"
    elsewhere.write_text("")
    (root / "state.lock").unlink()
    (root / "state.lock").symlink_to(elsewhere)
    fd = os.open(elsewhere, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], pass_fds=(fd,))
    os.close(fd)
    try:
        assert [r.repo_id for r in list_cache(cache_dir=cache)] == ["acme/l"]
    finally:
        holder.kill()
        holder.wait()


def test_fetch_says_nothing_else_is_in_use_only_where_nothing_else_is(hub: Any, isolated_hf_cache: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`_refused_beside_own` decides "nothing else is in use" by sum(own revisions' bytes) >= in_use; two revisions of
    one repo share their weights blob (counted once in in_use, twice in the sum), so a server's hold elsewhere was
    hidden: the refusal said the bound was taken by this command's sources only."""
    from vllm_lora_ext.cli import main
    from vllm_lora_ext.constants import ENV_DISK_CACHE_BYTES
    from vllm_lora_ext.diskholds import hold

    files = hub_adapter_files(0)
    repo = hub.repo("acme/x")
    c1 = repo.commit(files)
    c2 = repo.commit({**files, "adapter_config.json": files["adapter_config.json"] + b" "}, parent=c1)
    from safetensors.torch import save

    from factories import dense_tensors, llama_shapes

    small = {**files, "adapter_model.safetensors": save(dense_tensors(llama_shapes(targets=("q_proj",)), rank=2))}
    hub.repo("acme/s").commit(small)
    hub.repo("acme/big").commit(hub_adapter_files(2))
    size = sum(len(v) for v in files.values())
    s = resolve_source("hf:acme/s")
    server = hold("acme/s", s.commit, why="adapter 's' (registered)")  # another server's adapter
    try:
        cfg = len(files["adapter_config.json"])
        fits = size + 2 * cfg + 1 + sum(len(v) for v in small.values())  # x@c1 + x@c2 (one weights blob) + s
        monkeypatch.setenv(ENV_DISK_CACHE_BYTES, str(fits + size // 2))
        assert main(["fetch", f"hf:acme/x@{c1}", f"hf:acme/x@{c2}", "hf:acme/big"]) == 1
        err = capsys.readouterr().err
        assert "'hf:acme/big'" in err and "nothing else is in use" not in err, err
    finally:
        server.release()


def test_listing_inside_and_beside_a_held_state_lock(hub: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No deadlock: the thread that holds `locked` lists at once; another thread's listing waits for it, then lists;
    another process's listing waits while this one holds the lock (no timeout error before it is let go)."""
    cache, root = _cache(hub, tmp_path)
    monkeypatch.setattr(diskholds, "_LOCK_TIMEOUT_S", 20.0)
    got: list[Any] = []
    with diskholds.locked(root):
        assert [r.repo_id for r in list_cache(cache_dir=cache)] == ["acme/l"]
        t = threading.Thread(target=lambda: got.append(list_cache(cache_dir=cache)))
        t.start()
        child = subprocess.Popen([sys.executable, "-c", "import sys; from vllm_lora_ext.diskcache import list_cache; "
                                  f"print(len(list_cache(cache_dir={str(cache)!r})))"], stdout=subprocess.PIPE,
                                 text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        time.sleep(1.5)
        assert not got and child.poll() is None  # both wait for this thread's lock
    t.join(10)
    out, _ = child.communicate(timeout=60)
    assert len(got) == 1 and out.strip() == "1", (got, out)
