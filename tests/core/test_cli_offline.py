"""The CLI without a network, with mistyped paths, names and pipes (issue 37, items 5-10): answers within 2 s, names
offline mode when it is on, and gives concrete advice (the variables, the cache folder, HF_ENDPOINT)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from factories import lora_config, make_dense_adapter, write_adapter
from vllm_lora_ext.cli import main

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, err
    assert not re.search(r"[^.]\.\.(\s|$)", lines[0]), lines[0]  # no doubled period
    return lines[0]


@pytest.fixture
def closed_hub(monkeypatch: pytest.MonkeyPatch) -> str:
    """The Hub endpoint pointed at a local port nothing listens on, online (HF_HUB_OFFLINE=0)."""
    import huggingface_hub.constants as hc

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    monkeypatch.setattr(hc, "ENDPOINT", url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    return url


def _fails_within_2_s(argv: list[str]) -> None:
    """Run the CLI on ``argv``: it exits 1, answering within 2 s."""
    t0 = time.perf_counter()
    code = main(argv)
    seconds = time.perf_counter() - t0
    assert code == 1 and seconds <= 2.0, (code, seconds)


def test_fetch_with_hf_hub_offline_names_it_and_answers_at_once(
        isolated_hf_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails_within_2_s(["fetch", "hf:acme/x"])
    assert _error_line(capsys.readouterr().err) == (
        f"error: Adapter source 'hf:acme/x' is not in the local Hugging Face cache ('adapter_model.safetensors' at "
        f"revision 'main'; cache '{isolated_hf_cache}'), and offline mode is on (HF_HUB_OFFLINE=1), so the Hub was not "
        f"asked. 'vllm-lora fetch' downloads only with offline mode off: unset HF_HUB_OFFLINE (or set it to 0) and run "
        f"it again.")


def test_fetch_without_a_network_answers_within_2_s_with_concrete_advice_and_no_retries(
        closed_hub: str, isolated_hf_cache: Path, capfd: pytest.CaptureFixture[str]) -> None:
    _fails_within_2_s(["fetch", "hf:acme/x"])
    err = capfd.readouterr().err
    assert _error_line(err) == (
        f"error: Could not reach the Hugging Face Hub at '{closed_hub}' (Connection refused) for adapter source "
        f"'hf:acme/x', and 'adapter_model.safetensors' is not in the local cache ('{isolated_hf_cache}'). Check the "
        f"network, or set HF_ENDPOINT to a Hub or mirror that answers. Then run it again; HF_HOME or HF_HUB_CACHE "
        f"choose the cache.")
    assert err.strip().count("\n") == 0  # no retry lines: the one error line only


def test_inspect_of_an_uncached_hub_source_without_a_network_advises_fetch_and_offline_mode(
        closed_hub: str, isolated_hf_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails_within_2_s(["inspect", "hf:acme/x"])
    assert _error_line(capsys.readouterr().err).endswith(
        "Check the network, or set HF_ENDPOINT to a Hub or mirror that answers. To work from the cache only, fill it "
        "with 'vllm-lora fetch hf:acme/x' where the Hub is reachable, then set HF_HUB_OFFLINE=1.")


def test_fetch_logs_each_retry_of_a_busy_hub_once(hub: object, tmp_path: Path) -> None:
    make_dense_adapter(tmp_path / "a")
    repo = hub.repo("acme/busy")  # type: ignore[attr-defined]
    repo.commit({"adapter_model.safetensors": (tmp_path / "a/adapter_model.safetensors").read_bytes(),
                 "adapter_config.json": (tmp_path / "a/adapter_config.json").read_bytes()})
    hub.busy["adapter_model.safetensors"] = 2  # type: ignore[attr-defined]
    try:
        env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_HUB_CACHE": str(tmp_path / "cache"), "PYTHONPATH": SRC}
        out = subprocess.run([sys.executable, "-m", "vllm_lora_ext.cli", "fetch", "hf:acme/busy"], capture_output=True,
                             text=True, env=env, timeout=120)
    finally:
        hub.busy.clear()  # type: ignore[attr-defined]
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("Retrying in 1s [Retry 1/5].") == 1, out.stderr
    assert out.stderr.count("HTTP Error 503 thrown while requesting HEAD") == 1, out.stderr


@pytest.mark.parametrize("online", [False, True], ids=["HF_HUB_OFFLINE", "closed-port"])
def test_a_mistyped_relative_path_says_the_local_folder_does_not_exist_within_2_s(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], online: bool,
        request: pytest.FixtureRequest) -> None:
    if online:
        request.getfixturevalue("closed_hub")
    monkeypatch.chdir(tmp_path)
    make_dense_adapter(tmp_path / "ads" / "a2d")
    _fails_within_2_s(["inspect", "ads/a2dx"])
    line = _error_line(capsys.readouterr().err)
    assert line.startswith(f"error: No local folder 'ads/a2dx' ('{tmp_path / 'ads' / 'a2dx'}' does not exist); as a "
                           f"Hub repo: "), line
    assert ("offline mode is on (HF_HUB_OFFLINE=1)" in line) != online
    assert ("Could not reach the Hugging Face Hub" in line) == online


def test_mix_takes_names_from_vllm_lora_ext_config_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    make_dense_adapter(tmp_path / "style", seed=1)
    make_dense_adapter(tmp_path / "domain", seed=2)
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(f"adapters:\n  style: {tmp_path / 'style'}\n  domain: {tmp_path / 'domain'}\n")
    monkeypatch.setenv("VLLM_LORA_EXT_CONFIG", str(deploy))
    assert main(["mix", "style=0.7", "domain=0.3", "-o", "out"]) == 0  # as the README shows it
    assert capsys.readouterr().out.strip() == (
        f"wrote {tmp_path / 'out'} (rank-concatenated mix of 2 adapters; names from deployment config '{deploy}' "
        f"(from VLLM_LORA_EXT_CONFIG={deploy}))")
    monkeypatch.delenv("VLLM_LORA_EXT_CONFIG")
    assert main(["mix", "style=0.7", "nope=0.3", "-o", "out2", "--config", str(deploy)]) == 1
    assert _error_line(capsys.readouterr().err) == (
        f"error: 'nope' is not an adapter name of deployment config '{deploy}' (from --config {deploy}), and no local "
        f"folder 'nope' exists. It names ['domain', 'style']. Give a name it defines, a local adapter folder, or "
        f"hf:org/repo.")
    assert main(["mix", "style=0.7", "-o", "out2", "--config", "missing.yaml"]) == 1
    assert _error_line(capsys.readouterr().err) == (
        "error: Deployment config 'missing.yaml' (from --config missing.yaml) does not exist. Name the JSON or YAML "
        "file that maps adapter names to sources.")
    assert main(["mix", "nope=0.7", "-o", "out2"]) == 1
    assert _error_line(capsys.readouterr().err) == (
        "error: 'nope' is no local adapter folder, and there is no deployment config (pass --config FILE or set "
        "VLLM_LORA_EXT_CONFIG) to look the name up in. Give a local adapter folder or hf:org/repo, or name the "
        "deployment config.")
    assert not (tmp_path / "out2").exists()


def test_inspect_of_a_pickle_adapter_says_offline_tools_read_safetensors_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VLLM_LORA_EXT_ALLOW_PICKLE", "1")
    (tmp_path / "p").mkdir()
    torch.save({"base_model.model.m.q_proj.lora_A.weight": torch.ones(4, 8)}, tmp_path / "p" / "adapter_model.bin")
    write_adapter(tmp_path / "unused", {}, lora_config())
    (tmp_path / "p" / "adapter_config.json").write_text((tmp_path / "unused" / "adapter_config.json").read_text())
    for argv in (["inspect", "p"], ["convert", "p", "--to", "3d", "-o", "out"], ["mix", "p=1", "-o", "out"]):
        assert main(argv) == 1
        assert _error_line(capsys.readouterr().err) == (
            "error: Adapter 'p': offline tools (inspect, convert, mix) read .safetensors only, and 'adapter_model.bin' "
            "is a pickle file (VLLM_LORA_EXT_ALLOW_PICKLE lets only the server read it). Re-save it once as "
            "safetensors, e.g. PeftModel.from_pretrained(base, folder).save_pretrained(out).")
    assert not (tmp_path / "out").exists()
    # without the opt-in the offline tools give the same fix, not the server's opt-in (which they do not take)
    monkeypatch.delenv("VLLM_LORA_EXT_ALLOW_PICKLE")
    for argv in (["inspect", "p"], ["convert", "p", "--to", "3d", "-o", "out"], ["mix", "p=1", "-o", "out"]):
        assert main(argv) == 1
        line = _error_line(capsys.readouterr().err)
        assert "offline tools (inspect, convert, mix) read .safetensors only" in line and "Re-save it once" in line
        assert "opt in" not in line
    assert not (tmp_path / "out").exists()


def test_inspect_into_a_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    make_dense_adapter(tmp_path / "a")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": SRC}
    proc = subprocess.Popen([sys.executable, "-m", "vllm_lora_ext.cli", "inspect", str(tmp_path / "a"), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # as `| head` does once it has its lines: before this command writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and err == ""


def test_an_offline_hub_base_config_is_named_a_base_model_not_an_adapter_source(
        tmp_path: Path, isolated_hf_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_dense_adapter(tmp_path / "a")
    _fails_within_2_s(["inspect", str(tmp_path / "a"), "--base-config", "hf:Qwen/Qwen3-30B-A3B@main"])
    assert _error_line(capsys.readouterr().err) == (
        f"error: Base model 'hf:Qwen/Qwen3-30B-A3B@main' is not in the local Hugging Face cache ('config.json' at "
        f"revision 'main'; cache '{isolated_hf_cache}'), and offline mode is on (HF_HUB_OFFLINE=1), so the Hub was not "
        f"asked. Download it where the Hub is reachable ('hf download Qwen/Qwen3-30B-A3B config.json' into this "
        f"cache), or pass the model's config.json or its folder to --base-config, or unset HF_HUB_OFFLINE.")


def test_the_hub_probe_is_certain_only_without_a_proxy(closed_hub: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lora_ext.hub_client import hub_unreachable

    assert hub_unreachable() == "Connection refused"
    monkeypatch.setenv("https_proxy", "http://127.0.0.1:3128")  # a proxy may reach what this host cannot
    assert hub_unreachable() is None


@pytest.mark.parametrize("endpoint", ["not-a-url", "ftp://hub.example", "http://"])
def test_an_endpoint_that_is_no_http_address_is_named_as_the_problem(
        endpoint: str, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """huggingface_hub's own words were "Request URL is missing an 'http://' or 'https://' protocol", then "Retry"."""
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("https_proxy", "http://127.0.0.1:3128")  # named whatever a proxy might reach
    assert main(["inspect", "hf:acme/lora"]) == 1
    assert _error_line(capsys.readouterr().err) == (
        f"error: HF_ENDPOINT {endpoint!r} is no http:// or https:// address with a host, so 'adapter_model.safetensors' "
        f"of adapter source 'hf:acme/lora', which is not in the local cache ('{isolated_hf_cache}'), cannot be "
        f"downloaded. Set HF_ENDPOINT to a Hub or mirror address such as https://huggingface.co, or unset it.")


@pytest.mark.parametrize(("endpoint", "why"), [("http://hub.example:80a", "Port could not be cast to integer value as "
                                                "'80a'"), ("https://[::1", "Invalid IPv6 URL")])
def test_an_endpoint_that_stops_huggingface_hub_is_a_bad_setting_for_every_source(
        endpoint: str, why: str, tmp_path: Path) -> None:
    """huggingface_hub parses HF_ENDPOINT as it is imported: 'unexpected ValueError', or a bare traceback for a local
    adapter too (the CLI imports huggingface_hub for its logging)."""
    make_dense_adapter(tmp_path / "a")
    for offline in ("0", "1"):
        env = {**os.environ, "PYTHONPATH": SRC, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": offline,
               "HF_ENDPOINT": endpoint}
        for source in ("hf:acme/lora", str(tmp_path / "a")):
            out = subprocess.run([sys.executable, "-m", "vllm_lora_ext.cli", "inspect", source], env=env,
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 1 and _error_line(out.stderr) == (
                f"error: Bad settings: HF_ENDPOINT={endpoint!r} is no address huggingface_hub can read ({why}), and "
                f"it stops huggingface_hub, the cache included; set it to a Hub or mirror address such as "
                f"https://huggingface.co, or unset it."), out.stderr


def test_an_unreachable_hub_and_the_cache_folder_are_named_to_the_operator_not_to_the_client(
        closed_hub: str, isolated_hf_cache: Path) -> None:
    from vllm_lora_ext.errors import AdapterNotFoundError
    from vllm_lora_ext.sources import resolve_source

    with pytest.raises(AdapterNotFoundError) as info:
        resolve_source("hf:acme/unreached")
    for private in (closed_hub, str(isolated_hf_cache)):  # the server's Hub address and cache folder
        assert private in str(info.value) and private not in info.value.client_message()
    assert "Could not reach the Hugging Face Hub" in info.value.client_message()
