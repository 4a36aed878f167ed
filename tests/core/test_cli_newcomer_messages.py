"""What a newcomer met in the CLI in r44: advice that did not fit the situation, or that did not work when followed.
Each docstring says what went wrong before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save

from factories import dense_tensors, llama_shapes, lora_config, make_dense_adapter, tiny_tmpfs, write_adapter
from vllm_lora_ext import resolve_source
from vllm_lora_ext.cli import main
from vllm_lora_ext.constants import ENV_DISK_CACHE_BYTES

CONFIG = json.dumps(lora_config(r=4)).encode()


def weights(seed: int) -> bytes:
    return save(dense_tensors(llama_shapes(), rank=4, seed=seed))


def kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
        prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    import vllm_lora_ext

    env = {**os.environ, **(env or {}), "PYTHONPATH": str(Path(vllm_lora_ext.__file__).parents[1])}
    return subprocess.run([*(prefix or []), sys.executable, "-m", "vllm_lora_ext.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def tree(folder: Path) -> dict[str, tuple[int, int]]:
    """Every entry under ``folder``: its size and modification time."""
    return {str(p.relative_to(folder)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in folder.rglob("*")}


def test_fetch_refused_beside_only_its_own_sources_says_to_raise_the_bound_naming_the_sizes(
        hub: Any, isolated_hf_cache: Path) -> None:
    """`vllm-lora fetch A B` under a bound that holds A but not A and B: the only holder of A is the fetch itself
    (it keeps each fetched source until it ends), yet B's refusal said "Unload adapters that are no longer needed",
    of which there were none."""
    for i in range(2):
        hub.repo(f"acme/f{i}").commit({"adapter_model.safetensors": weights(i), "adapter_config.json": CONFIG})
    big = save(dense_tensors(llama_shapes(), rank=16, seed=2))
    hub.repo("acme/big").commit({"adapter_model.safetensors": big, "adapter_config.json": CONFIG})
    rev = len(weights(0)) + len(CONFIG)
    assert len(big) > rev * 3 // 2
    done = cli("fetch", "hf:acme/f0", "hf:acme/f1", "hf:acme/big", env={ENV_DISK_CACHE_BYTES: str(rev * 3 // 2)})
    assert done.returncode == 1 and "hf:acme/f0 ->" in done.stdout, done.stderr
    err, too_large = done.stderr.splitlines()
    assert "Unload" not in err, err
    assert "'hf:acme/big' needs" in too_large and "more than the whole disk cache bound" in too_large, too_large
    assert f"{kib(rev)} of it is taken by the 1 source this command fetched before (hf:acme/f0@" in err, err
    assert f"Raise {ENV_DISK_CACHE_BYTES} to fit the sources together: more than {kib(rev + len(weights(1)))}" in err
    done = cli("fetch", "hf:acme/f0", "hf:acme/f1", env={ENV_DISK_CACHE_BYTES: str(2 * rev + 1024)})  # the fix works
    assert done.returncode == 0, done.stderr


def test_an_output_that_is_the_current_non_empty_folder_names_a_fix_that_works(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`vllm-lora mix ... -o .` in a non-empty folder said "pass --force to replace the adapter files in it", and
    with --force it was refused: the current folder cannot be replaced."""
    make_dense_adapter(tmp_path / "a")
    monkeypatch.chdir(tmp_path)
    assert main(["mix", "a=1", "-o", "."]) == 1
    err = capsys.readouterr().err
    assert "--force" not in err and "is the current folder" in err and "-o ./adapter" in err, err
    assert main(["mix", "a=1", "-o", "./adapter"]) == 0  # the fix it names works
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_an_output_on_a_read_only_or_virtual_file_system_is_refused_with_that_reason(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`-o /proc/x` said "Cannot write into '/proc' (No such file or directory)": /proc exists; it takes no new
    files. On a read-only file system the reason must say read-only."""
    a = make_dense_adapter(tmp_path / "a")
    assert main(["mix", str(a), "-o", "/proc/x"]) == 1
    err = capsys.readouterr().err
    assert "No such file or directory" not in err and "virtual file system" in err, err
    assert "Choose an output folder you can write to" in err
    with tiny_tmpfs("1m") as disk:
        remount = subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True, text=True, timeout=30)
        if remount.returncode != 0:
            pytest.skip(f"cannot remount a tmpfs read-only here: {remount.stderr.strip()[:200]}")
        assert main(["mix", str(a), "-o", str(disk / "out")]) == 1
        err = capsys.readouterr().err
        assert f"Cannot write into {str(disk)!r}: it is on a read-only file system" in err, err


def test_verify_without_a_gpu_says_so_before_downloading_an_hf_adapter(hub: Any, isolated_hf_cache: Path) -> None:
    """`vllm-lora verify MODEL hf:org/adapter` downloaded the adapter (or waited on a silent Hub) before saying that
    no GPU is visible; the cheap local check comes first."""
    hub.repo("acme/v").commit({"adapter_model.safetensors": weights(0), "adapter_config.json": CONFIG})
    done = cli("verify", "org/model", "hf:acme/v", env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2 and "cannot run here" in done.stderr, done.stderr
    assert hub.requests == [] and not list(isolated_hf_cache.glob("models--acme--v")), hub.requests
    done = cli("verify", "org/model", "hf:acme/v@", env={"CUDA_VISIBLE_DEVICES": ""})  # a malformed source: at once
    assert done.returncode == 2 and "empty revision" in done.stderr, done.stderr


def test_a_mix_that_overflows_names_the_inputs_and_output_the_user_gave(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A mix whose weighted factors pass float16's range was refused as "Adapter 'mix': tensor ... holds NaN or
    infinite values": no input or output the user gave is called 'mix'."""
    for name in ("big1", "big2"):  # A of 30000 in float16, scaling 2: a weight of 2 passes 65504
        tensors = {k: (torch.full_like(v, 30000.0) if "lora_A" in k else v).half()
                   for k, v in dense_tensors(llama_shapes(), rank=4, seed=1).items()}
        write_adapter(tmp_path / name, tensors, lora_config(r=4, alpha=8))
    monkeypatch.chdir(tmp_path)
    assert main(["mix", "big1=2", "big2=1", "-o", "out"]) == 1
    err = capsys.readouterr().err
    assert "'mix'" not in err, err
    assert f"The mix big1=2 big2=1 into {str(tmp_path / 'out')!r} overflows float16" in err, err
    assert "Lower the weights" in err and "65504" in err and not (tmp_path / "out").exists()


def test_cache_ls_writes_nothing_and_lists_a_read_only_cache(hub: Any, tmp_path: Path) -> None:
    """`vllm-lora cache ls` took the plugin's write lock: it made `.locks/vllm_lora_ext/state.lock` where it was
    missing, removed ended processes' holds files, and on a read-only cache failed with "Read-only file system"."""
    hub.repo("acme/l").commit({"adapter_model.safetensors": weights(0), "adapter_config.json": CONFIG})
    cache = tmp_path / "cache"
    resolve_source("hf:acme/l", cache_dir=cache)
    root = cache / ".locks" / "vllm_lora_ext"
    (root / "state.lock").unlink()
    (root / "holds").mkdir(exist_ok=True)
    (root / "holds" / "123-dead.lock").write_text("")  # a process that ended: no one holds its lock
    (root / "holds" / "123-dead.json").write_text(json.dumps({"pid": 123, "holds": []}))
    before = tree(cache)
    done = cli("cache", "ls", "--cache-dir", str(cache))
    assert done.returncode == 0 and "acme/l@" in done.stdout and "1 revisions" in done.stdout, done.stderr
    assert tree(cache) == before
    done = cli("cache", "ls", "--cache-dir", str(tmp_path / "nosuch"))
    assert done.returncode == 0 and "does not exist" in done.stderr and not (tmp_path / "nosuch").exists()
    with tiny_tmpfs("4m") as disk:
        subprocess.run(["cp", "-a", f"{cache}/.", str(disk)], check=True, timeout=60)
        remount = subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True, text=True, timeout=30)
        if remount.returncode != 0:
            pytest.skip(f"cannot remount a tmpfs read-only here: {remount.stderr.strip()[:200]}")
        done = cli("cache", "ls", "--cache-dir", str(disk))
        assert done.returncode == 0 and "acme/l@" in done.stdout, done.stderr


def test_mix_refused_beside_only_its_own_inputs_says_to_raise_the_bound_not_to_unload(
        hub: Any, isolated_hf_cache: Path, tmp_path: Path) -> None:
    """`vllm-lora mix hf:A hf:B` under a bound that holds A but not A and B: the only holder of A is the mix itself
    (it keeps each input until it ends), yet B's refusal said "Unload adapters that are no longer needed"; fetch
    said the truth (r44), mix did not."""
    for i in range(2):
        hub.repo(f"acme/m{i}").commit({"adapter_model.safetensors": weights(i), "adapter_config.json": CONFIG})
    rev = len(weights(0)) + len(CONFIG)
    out = str(tmp_path / "out")
    done = cli("mix", "hf:acme/m0", "hf:acme/m1", "-o", out, env={ENV_DISK_CACHE_BYTES: str(rev * 3 // 2)})
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "Unload" not in done.stderr, done.stderr
    assert f"{kib(rev)} of it is taken by the 1 source this command read before (hf:acme/m0@" in done.stderr
    assert f"Raise {ENV_DISK_CACHE_BYTES} to fit the sources together: more than {kib(rev + len(weights(1)))}" \
        in done.stderr and "or mix fewer adapters." in done.stderr, done.stderr
    done = cli("mix", "hf:acme/m0", "hf:acme/m1", "-o", out, env={ENV_DISK_CACHE_BYTES: str(2 * rev + 1024)})
    assert done.returncode == 0, done.stderr  # the bound it names works


def test_inspect_refused_for_its_base_config_beside_its_adapter_names_the_bound_that_fits(
        hub: Any, isolated_hf_cache: Path) -> None:
    """`vllm-lora inspect hf:A --base-config hf:org/model` under a bound that holds A but not A and the model's
    config.json: what fills the bound is the adapter inspect itself holds, yet the refusal said "Unload adapters"."""
    hub.repo("acme/i").commit({"adapter_model.safetensors": weights(0), "adapter_config.json": CONFIG})
    rev = len(weights(0)) + len(CONFIG)
    base = json.dumps({"model_type": "llama", "hidden_size": 64, "padding": "x" * rev}).encode()
    hub.repo("acme/model").commit({"config.json": base})
    done = cli("inspect", "hf:acme/i", "--base-config", "hf:acme/model", env={ENV_DISK_CACHE_BYTES: str(rev * 3 // 2)})
    assert done.returncode == 1 and "Traceback" not in done.stderr and "Unload" not in done.stderr, done.stderr
    assert "Source 'hf:acme/model' needs" in done.stderr, done.stderr
    assert f"{kib(rev)} of it is taken by the 1 source this command read before (hf:acme/i@" in done.stderr
    assert f"more than {kib(rev + len(base))}" in done.stderr, done.stderr
    assert "or give --base-config the model's config.json as a local file." in done.stderr, done.stderr
    done = cli("inspect", "hf:acme/i", "--base-config", "hf:acme/model",
               env={ENV_DISK_CACHE_BYTES: str(rev + len(base) + 1024)})
    assert done.returncode == 0, done.stderr  # the bound it names works


@pytest.mark.parametrize("why", ["read-only", "permission"])
def test_cache_prune_of_a_cache_it_cannot_write_names_the_folder_the_reason_and_the_fix(
        hub: Any, tmp_path: Path, why: str) -> None:
    """`vllm-lora cache prune` on a read-only cache printed "error: [Errno 30] Read-only file system: '.../state.lock'"
    (and "[Errno 13] Permission denied" on one this user may not write): no cache folder, no reason, no fix."""
    hub.repo("acme/p").commit({"adapter_model.safetensors": weights(0), "adapter_config.json": CONFIG})
    cache = tmp_path / "cache"
    resolve_source("hf:acme/p", cache_dir=cache)
    if why == "permission":  # root without its capabilities, on a cache another user owns: EACCES as for any user
        if subprocess.run(["setpriv", "--version"], capture_output=True).returncode != 0 or os.geteuid() != 0:
            pytest.skip("needs root and setpriv to drop root's permission override")
        subprocess.run(["chown", "-R", "65534:65534", str(cache)], check=True, timeout=60)
        done = cli("cache", "prune", "--max-bytes", "0", "--cache-dir", str(cache),
                   prefix=["setpriv", "--inh-caps=-all", "--bounding-set=-all"])
        assert done.returncode == 1 and "Traceback" not in done.stderr and "Errno" not in done.stderr, done.stderr
        assert f"Cannot prune the Hugging Face cache {str(cache)!r}: permission denied" in done.stderr, done.stderr
        assert "nothing was evicted" in done.stderr, done.stderr
        assert "Run 'vllm-lora cache prune' as the user that owns the cache" in done.stderr, done.stderr
        assert (cache / "models--acme--p").is_dir()
        cache.chmod(0o700)  # nor may it read it: `cache ls` said "[Errno 13] Permission denied: '.../ledger.json'"
        done = cli("cache", "ls", "--cache-dir", str(cache), prefix=["setpriv", "--inh-caps=-all", "--bounding-set=-all"])
        assert done.returncode == 1 and "Traceback" not in done.stderr and "Errno" not in done.stderr, done.stderr
        assert f"Cannot list the Hugging Face cache {str(cache)!r}: permission denied: this user may not read it" \
            in done.stderr and "or give this user read access to it" in done.stderr, done.stderr
        return
    with tiny_tmpfs("4m") as disk:
        subprocess.run(["cp", "-a", f"{cache}/.", str(disk)], check=True, timeout=60)
        remount = subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True, text=True, timeout=30)
        if remount.returncode != 0:
            pytest.skip(f"cannot remount a tmpfs read-only here: {remount.stderr.strip()[:200]}")
        done = cli("cache", "prune", "--max-bytes", "0", env={"HF_HUB_CACHE": str(disk)})
        assert done.returncode == 1 and "Traceback" not in done.stderr and "Errno" not in done.stderr, done.stderr
        assert f"Cannot prune the Hugging Face cache {str(disk)!r}: it is on a read-only file system" in done.stderr
        assert "nothing was evicted. Remount it read-write" in done.stderr and "--cache-dir DIR" in done.stderr
