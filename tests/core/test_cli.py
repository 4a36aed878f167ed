"""The vllm-lora CLI: inspect, convert (exact round trips), mix (exact, loadable by PEFT), EP read plans."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from factories import make_dense_adapter, make_peft_adapter, tiny_llama
from moe_factories import KeyByKey, dense_delta, make_truth, oracle_deltas, write_moe_adapter
from vllm_lora_ext.cli import main
from vllm_lora_ext.offline_ops import load_adapter_files
from vllm_lora_ext.reader import ReadStats, SafetensorsReader
from vllm_lora_ext.sources import resolve_source

E, H, I, R = 8, 32, 12, 4
SRC = str(Path(__file__).resolve().parents[2] / "src")
BASE = {"num_experts": E, "hidden_size": H, "moe_intermediate_size": I}


def test_inspect_prints_modules_ranks_scaling_and_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_dense_adapter(tmp_path, rank=4, alpha=8)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "layout      dense" in out and "r / alpha   4 / 8" in out
    assert "model.layers.1.self_attn.v_proj" in out and "4x16" in out and "8x4" in out and " 2 " in out
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layout"] == "dense" and len(data["modules"]) == 4 and data["modules"][0]["scaling"] == 2.0


def test_inspect_says_ep_size_has_no_effect_on_an_adapter_with_no_experts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_dense_adapter(tmp_path, rank=4, alpha=8)
    assert main(["inspect", str(tmp_path), "--ep-size", "4"]) == 0
    err = capsys.readouterr().err
    assert "--ep-size has no effect" in err and "no expert weights" in err and "layout dense" in err


def test_the_cli_refuses_a_misspelt_setting_as_the_server_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI reads settings too (``fetch`` and ``cache`` the disk bound, ``mix`` the deployment config): a
    misspelt one, which would leave the bound off, exits 1 naming the setting meant."""
    make_dense_adapter(tmp_path, rank=4, alpha=8)
    monkeypatch.setenv("VLLM_LORA_EXT_DISK_CACHE_BYTE", "1000")
    assert main(["inspect", str(tmp_path)]) == 1
    assert "did you mean VLLM_LORA_EXT_DISK_CACHE_BYTES?" in capsys.readouterr().err


def test_inspect_of_a_missing_source_exits_1_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path / "nope")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_inspect_reads_headers_without_importing_torch(tmp_path: Path) -> None:
    make_dense_adapter(tmp_path / "dense", rank=4, alpha=8)
    write_moe_adapter(tmp_path / "moe", [make_truth(E, H, I, R, 0)], ["3d"], rank=R)
    code = ("import sys; from vllm_lora_ext.cli import main\n"
            "codes = [main(['inspect', sys.argv[1]]), main(['inspect', sys.argv[1], '--json']),"
            " main(['inspect', sys.argv[2]]), main(['inspect', sys.argv[2], '--json'])]\n"
            "print(codes, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "dense"), str(tmp_path / "moe")],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "[0, 0, 0, 0] False"  # (reads only headers: torch is for --values)


def test_inspect_moe_3d_infers_sizes_without_a_base_config_and_reports_layout_and_ep_reads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_moe_adapter(tmp_path / "a", [make_truth(E, H, I, R, 0), make_truth(E, H, I, R, 1)], ["3d", "3d_gu+2d_down"],
                      rank=R)
    assert main(["inspect", str(tmp_path / "a"), "--json"]) == 0
    inferred = json.loads(capsys.readouterr().out)["moe_blocks"]["model.layers.0.mlp.experts"]
    assert (inferred["experts"], inferred["hidden"], inferred["intermediate"]) == (E, H, I)
    assert inferred["sizes"].startswith("inferred: E=8 (rows 32 / the config's rank); H=32, I=12")
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert main(["inspect", str(tmp_path / "a"), "--base-config", str(tmp_path / "config.json"), "--ep-size", "4",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layout"] == "moe_mixed"
    assert data["moe_blocks"]["model.layers.1.mlp.experts"]["layout"] == "2d+3d"
    # the plan's bytes for rank 2 equal what reading rank 2's experts actually reads
    from vllm_lora_ext.formats.moe import MoESpec
    from vllm_lora_ext.formats.moe_plan import plan_experts
    from vllm_lora_ext.formats.moe_read import read_experts
    from vllm_lora_ext.summary import load_config

    r = resolve_source(str(tmp_path / "a"))
    stats = ReadStats()
    reader = SafetensorsReader(r.weights_path, stats=stats)
    cfg = load_config(r)
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        keys = {k: s for k, s in reader.header.shapes.items() if f".{p}." in k}
        read_experts(plan_experts(keys, MoESpec(p, E, H, I), config=cfg), KeyByKey(reader.read, reader.read_many),
                     config=cfg, experts=[4, 5])
    assert data["ep"][2]["bytes"] == stats.bytes_read


@pytest.mark.parametrize("form", ["2d", "3d", "3d_t", "2d_gu+3d_down"])
def test_convert_round_trips_keep_the_delta_exactly(tmp_path: Path, form: str) -> None:
    t = make_truth(E, H, I, R, 0)
    write_moe_adapter(tmp_path / "src", [t], [form], rank=R, alpha=16)  # type: ignore[list-item]
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    cfg = ["--base-config", str(tmp_path / "config.json")]
    if form == "3d":  # already standard 3D: converting it to 3D is refused as a no-op
        assert main(["convert", str(tmp_path / "src"), "--to", "3d", "-o", str(tmp_path / "as3d"), *cfg]) == 1
        assert main(["convert", str(tmp_path / "src"), "--to", "2d", "-o", str(tmp_path / "src2d"), *cfg]) == 0
        assert main(["convert", str(tmp_path / "src2d"), "--to", "3d", "-o", str(tmp_path / "as3d"), *cfg]) == 0
    else:
        assert main(["convert", str(tmp_path / "src"), "--to", "3d", "-o", str(tmp_path / "as3d"), *cfg]) == 0
    assert main(["convert", str(tmp_path / "as3d"), "--to", "2d", "-o", str(tmp_path / "back"), *cfg]) == 0
    oracle = oracle_deltas(t, 16 / R)
    for folder in ("as3d", "back"):
        la = load_adapter_files(resolve_source(str(tmp_path / folder)), base_config=BASE)
        ex = la.moe["model.layers.0.mlp.experts"]
        for e in range(E):
            d = dense_delta(ex, e)
            for proj in ("gate", "up", "down"):
                torch.testing.assert_close(d[proj], oracle[proj][e], rtol=1e-5, atol=1e-6)


def test_convert_3d_to_2d_and_back_gives_the_same_file_tensors(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    write_moe_adapter(tmp_path / "src", [make_truth(E, H, I, R, 2)], ["3d"], rank=R)
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    cfg = ["--base-config", str(tmp_path / "config.json")]
    assert main(["convert", str(tmp_path / "src"), "--to", "2d", "-o", str(tmp_path / "as2d"), *cfg]) == 0
    assert main(["convert", str(tmp_path / "as2d"), "--to", "3d", "-o", str(tmp_path / "back"), *cfg]) == 0
    assert "--rename has no effect" not in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "as2d"), "--to", "3d", "-o", str(tmp_path / "back2"), "--rename", *cfg]) == 0
    assert "note: --rename has no effect with --to 3d" in capsys.readouterr().err  # said, not silently ignored
    a, b = load_file(str(tmp_path / "src/adapter_model.safetensors")), load_file(str(tmp_path / "back/adapter_model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_mix_writes_the_exact_weighted_sum_and_peft_loads_it(tmp_path: Path) -> None:
    import peft

    model = tiny_llama()
    make_peft_adapter(model, tmp_path / "a", targets=["q_proj", "v_proj"], rank=4, alpha=8, seed=1)
    make_peft_adapter(tiny_llama(), tmp_path / "b", targets=["q_proj", "o_proj"], rank=8, alpha=4, seed=2, use_rslora=True)
    assert main(["mix", f"{tmp_path / 'a'}=0.7", f"{tmp_path / 'b'}=-0.3", "-o", str(tmp_path / "mix")]) == 0
    la = load_adapter_files(resolve_source(str(tmp_path / "a")))
    lb = load_adapter_files(resolve_source(str(tmp_path / "b")))
    pm = peft.PeftModel.from_pretrained(tiny_llama(), str(tmp_path / "mix"))
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.o_proj", "model.layers.1.self_attn.v_proj"):
        expected = torch.zeros(64, 64) if "o_proj" in name or "q_proj" in name else torch.zeros(32, 64)
        for la_, w in ((la, 0.7), (lb, -0.3)):
            if name in la_.dense:
                a, b = la_.dense[name]
                expected = expected + w * la_.config.scaling_for(name, a.shape[0]) * (b @ a)
        layer = pm.base_model.model.get_submodule(name)
        got = layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("first", ["float32", "bfloat16"])
def test_mix_of_a_float32_and_a_bfloat16_adapter_is_written_in_float32_in_either_order(
        tmp_path: Path, first: str, capsys: pytest.CaptureFixture[str]) -> None:
    from factories import dense_tensors, llama_shapes, lora_config, write_adapter

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    order = [first, "bfloat16" if first == "float32" else "float32"]
    for i, name in enumerate(order):
        write_adapter(tmp_path / name, dense_tensors(llama_shapes(), rank=4, seed=i, dtype=dtypes[name]),
                      lora_config(4, 8, ("q_proj", "v_proj")))
    assert main(["mix", *(f"{tmp_path / n}=0.5" for n in order), "-o", str(tmp_path / "mix")]) == 0
    assert "dtypes differ" in capsys.readouterr().err
    got = load_file(str(tmp_path / "mix" / "adapter_model.safetensors"))
    assert {t.dtype for t in got.values()} == {torch.float32}
    f32 = load_file(str(tmp_path / "float32" / "adapter_model.safetensors"))
    key = next(k for k in got if "lora_A" in k)
    rows = slice(0, 4) if first == "float32" else slice(4, 8)
    assert torch.equal(got[key][rows], f32[key] * 0.5 * 2.0)  # w · s · A, unrounded: float32 kept its bits


def test_mix_of_moe_adapters_is_exact_per_expert(tmp_path: Path) -> None:
    t1, t2 = make_truth(E, H, I, R, 3), make_truth(E, H, I, 2 * R, 4)
    write_moe_adapter(tmp_path / "a", [t1], ["2d"], rank=R, alpha=8)
    write_moe_adapter(tmp_path / "b", [t2], ["3d"], rank=2 * R, alpha=8)
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert main(["mix", f"{tmp_path / 'a'}=0.5", f"{tmp_path / 'b'}=2", "-o", str(tmp_path / "m"),
                 "--base-config", str(tmp_path / "config.json")]) == 0
    ex = load_adapter_files(resolve_source(str(tmp_path / "m")), base_config=BASE).moe["model.layers.0.mlp.experts"]
    o1, o2 = oracle_deltas(t1, 8 / R), oracle_deltas(t2, 8 / (2 * R))
    for e in (0, 7):
        d = dense_delta(ex, e)
        for proj in ("gate", "up", "down"):
            torch.testing.assert_close(d[proj], 0.5 * o1[proj][e] + 2 * o2[proj][e], rtol=1e-4, atol=1e-5)


def test_convert_2d_with_distinct_gate_and_up_a_to_3d_folds_scaling_and_keeps_the_delta(tmp_path: Path) -> None:
    from moe_factories import block_tensors

    from factories import lora_config, write_adapter

    t = make_truth(E, H, I, R, 5)
    ts = block_tensors("model.layers.0.mlp", t, "2d")
    g = torch.Generator().manual_seed(9)
    for e in range(E):  # up gets its own A: the fused gate_up needs rank 2r
        ts[f"base_model.model.model.layers.0.mlp.experts.{e}.up_proj.lora_A.weight"] = torch.randn(R, H, generator=g)
    write_adapter(tmp_path / "src", ts, lora_config(R, 16, use_rslora=True))
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert main(["convert", str(tmp_path / "src"), "--to", "3d", "-o", str(tmp_path / "as3d"),
                 "--base-config", str(tmp_path / "config.json")]) == 0
    src = load_adapter_files(resolve_source(str(tmp_path / "src")), base_config=BASE).moe["model.layers.0.mlp.experts"]
    out = load_adapter_files(resolve_source(str(tmp_path / "as3d")), base_config=BASE).moe["model.layers.0.mlp.experts"]
    assert out.gate_up is not None and out.gate_up.rank == 2 * R
    for e in range(E):
        a, b = dense_delta(src, e), dense_delta(out, e)
        for proj in ("gate", "up", "down"):
            torch.testing.assert_close(a[proj], b[proj], rtol=1e-5, atol=1e-6)


def test_fetch_then_offline_inspect_of_an_hf_source(hub, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                                    tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_dense_adapter(tmp_path / "a", rank=4, alpha=8)
    sha = hub.repo("acme/cli").commit({"x/w.safetensors": (tmp_path / "a/adapter_model.safetensors").read_bytes(),
                                       "x/w_config.json": (tmp_path / "a/adapter_config.json").read_bytes()})
    assert main(["fetch", "hf:acme/cli:x/w.safetensors", "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip())
    assert record["commit"] == sha and record["pinned"] == f"hf:acme/cli@{sha}:x/w.safetensors"
    assert record["config_rule"] == "<stem>_config.json"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # offline, one source missing from the cache does not hide the others: each gets its line, exit 1
    assert main(["fetch", "hf:acme/missing", "hf:acme/cli:x/w.safetensors", "--json"]) == 1
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert [line["source"] for line in lines] == ["hf:acme/missing", "hf:acme/cli:x/w.safetensors"]
    assert "not in the local Hugging Face cache" in lines[0]["error"] and lines[1]["commit"] == sha
    assert captured.err.startswith("error: ")
    # offline, the repo cached but not the named file: the message lists what the cached snapshot holds
    assert main(["inspect", "hf:acme/cli:x/other.safetensors"]) == 1
    assert "The cached snapshot of this revision holds ['x/w.safetensors']" in capsys.readouterr().err
    before = hub.count()
    assert main(["inspect", "hf:acme/cli:x/w.safetensors"]) == 0
    out = capsys.readouterr().out
    assert f"commit      {sha}" in out and "rule: <stem>_config.json" in out and hub.count() == before
    # the config missing from the cache (its weights there): no list of weight files, which would not help
    for config in Path(os.environ["HF_HUB_CACHE"]).glob("models--acme--cli/snapshots/*/x/w_config.json"):
        config.unlink()
    assert main(["inspect", "hf:acme/cli:x/w.safetensors"]) == 1
    err = capsys.readouterr().err
    assert "'x/w_config.json'" in err and "holds" not in err


def test_convert_3d_to_2d_without_a_base_config_writes_the_same_tensors_as_with_it(tmp_path: Path) -> None:
    write_moe_adapter(tmp_path / "src", [make_truth(E, H, I, R, 5), make_truth(E, H, I, R, 6)], ["3d_t", "3d_t"], rank=R,
                      peft_version="0.17.0")  # the transposed form, as PEFT 0.17 wrote it
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert main(["convert", str(tmp_path / "src"), "--to", "2d", "-o", str(tmp_path / "inferred")]) == 0
    assert main(["convert", str(tmp_path / "src"), "--to", "2d", "-o", str(tmp_path / "given"),
                 "--base-config", str(tmp_path)]) == 0  # a model folder holding config.json
    a = load_file(str(tmp_path / "inferred" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "given" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_fused_block_whose_shapes_do_not_settle_the_sizes_is_named_by_inspect_and_refused_by_convert(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_lora_ext.formats import PEFT_PREFIX

    t = make_truth(E, H, I, R, 7)
    p = f"{PEFT_PREFIX}model.layers.0.mlp.experts"
    from factories import lora_config, write_adapter

    write_adapter(tmp_path / "src", {f"{p}.lora_A.weight": t.ad.reshape(E * R, I).contiguous(),
                                     f"{p}.lora_B.weight": t.bd.permute(1, 2, 0).reshape(H, R * E).contiguous()},
                  lora_config(R, 8, ["down_proj"]))  # only a fused down: gate_up or down, either orientation
    assert main(["inspect", str(tmp_path / "src")]) == 0
    out = capsys.readouterr().out
    assert "sizes not settled" in out and "read as several models" in out and "--base-config" in out
    assert main(["convert", str(tmp_path / "src"), "--to", "2d", "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "read as several models" in err and "--base-config" in err and not (tmp_path / "out").exists()
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert main(["convert", str(tmp_path / "src"), "--to", "2d", "-o", str(tmp_path / "out"),
                 "--base-config", str(tmp_path / "config.json")]) == 0


def test_base_config_from_the_hub_downloads_only_config_json(tmp_path: Path, hub: object) -> None:
    from vllm_lora_ext.offline_ops import load_base_config

    repo = hub.repo("acme/base-model")  # type: ignore[attr-defined]
    repo.commit({"config.json": json.dumps(BASE).encode(), "model.safetensors": b"\0" * 4096})
    assert load_base_config("hf:acme/base-model") == BASE
    assert not any("model.safetensors" in path for _, path in hub.requests)  # type: ignore[attr-defined]


def test_inspect_uses_the_base_models_config_from_the_local_cache_and_says_so(
        tmp_path: Path, hub: object, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_lora_ext.offline_ops import load_base_config

    # a fused down-only block: its shapes alone cannot settle H and I (see the test above)
    from vllm_lora_ext.formats import PEFT_PREFIX
    from factories import lora_config, write_adapter

    hub.repo("acme/base-model").commit({"config.json": json.dumps(BASE).encode()})  # type: ignore[attr-defined]
    load_base_config("hf:acme/base-model")  # fills the local cache (the test runs online against the local hub)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t = make_truth(E, H, I, R, 7)
    p = f"{PEFT_PREFIX}model.layers.0.mlp.experts"
    write_adapter(tmp_path / "src", {f"{p}.lora_A.weight": t.ad.reshape(E * R, I).contiguous(),
                                     f"{p}.lora_B.weight": t.bd.permute(1, 2, 0).reshape(H, R * E).contiguous()},
                  lora_config(R, 8, ["down_proj"], base_model_name_or_path="acme/base-model"))
    assert main(["inspect", str(tmp_path / "src")]) == 0
    out = capsys.readouterr().out
    assert "base config: acme/base-model (config.json from the local Hugging Face cache)" in out
    assert "E=8 H=32 I=12" in out and "sizes not settled" not in out


@pytest.mark.parametrize("given", [["--base-config", "wrong"], ["--num-experts", str(E // 2)],
                                   ["--num-experts", str(2 * E)]], ids=["base-config", "fewer", "more"])
def test_sizes_given_that_contradict_the_adapter_are_refused_never_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], given: list[str]) -> None:
    """A base config (or --num-experts) of another model read the fused rows r·E as other ranks: convert wrote a
    wrong adapter with exit 0, and inspect --strict passed it (a newcomer's finding)."""
    write_moe_adapter(tmp_path / "src", [make_truth(E, H, I, R, 1)], ["3d"], rank=R)
    (tmp_path / "wrong.json").write_text(json.dumps({**BASE, "num_experts": 2 * E}))
    given = [str(tmp_path / "wrong.json") if g == "wrong" else g for g in given]
    assert main(["convert", str(tmp_path / "src"), "--to", "2d", "-o", str(tmp_path / "out"), *given]) == 1
    err = capsys.readouterr().err
    assert f"lora_A of {R * E} rows (r × E)" in err and f"its config's r {R} makes E = {E}" in err, err
    assert not (tmp_path / "out").exists()
    if given[0] == "--base-config":
        assert main(["inspect", "--strict", str(tmp_path / "src"), *given]) == 1
        out = capsys.readouterr()
        assert "the sizes given contradict the adapter" in out.out and "r × E" in out.out + out.err
    assert main(["convert", str(tmp_path / "src"), "--to", "2d", "-o", str(tmp_path / "right")]) == 0  # control


def test_an_adapter_with_no_lora_weights_is_refused_by_inspect_mix_and_the_loader(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import save_file

    from vllm_lora_ext.config import config_from_dict
    from vllm_lora_ext.errors import AdapterFormatError
    from vllm_lora_ext.planning import ModelSpec, PeftKeyRouter, plan_adapter
    from vllm_lora_ext.validation import ModuleDims

    empty = tmp_path / "empty"
    empty.mkdir()
    save_file({}, str(empty / "adapter_model.safetensors"))
    (empty / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
                                                           "peft_type": "LORA"}))
    assert main(["inspect", "--strict", str(empty)]) == 1
    assert "holds no LoRA weights (its weight file has 0 tensors" in capsys.readouterr().out
    good = make_dense_adapter(tmp_path / "good")
    assert main(["mix", str(good), str(empty), "-o", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert "holds no LoRA weights" in err and "unexpected" not in err and not (tmp_path / "m").exists()
    spec = ModelSpec(frozenset({"m.q_proj"}), {"m.q_proj": ModuleDims(16, 16)})
    with pytest.raises(AdapterFormatError, match="holds no LoRA weights"):
        plan_adapter({}, config_from_dict({"r": 4}), spec, router=PeftKeyRouter())


def test_mix_takes_the_model_syntax_as_well_as_separate_items(tmp_path: Path) -> None:
    a, b = make_dense_adapter(tmp_path / "a", seed=1), make_dense_adapter(tmp_path / "b", seed=2)
    assert main(["mix", f"{a}=0.7", f"{b}=0.3", "-o", str(tmp_path / "apart")]) == 0
    assert main(["mix", f"{a}=0.7+{b}=0.3", "-o", str(tmp_path / "joined")]) == 0
    x = load_file(str(tmp_path / "apart" / "adapter_model.safetensors"))
    y = load_file(str(tmp_path / "joined" / "adapter_model.safetensors"))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_the_log_flags_work_after_the_command_too() -> None:
    from vllm_lora_ext.cli import _parser

    assert _parser().parse_args(["inspect", "-vv", "x"]).verbose == 2
    assert _parser().parse_args(["-v", "mix", "a", "-o", "o"]).verbose == 1
    assert _parser().parse_args(["fetch", "-q", "hf:a/b"]).quiet is True
    assert _parser().parse_args(["fetch", "hf:a/b"]).quiet is False
    assert _parser().parse_args(["cache", "ls", "-v"]).verbose == 1  # a nested command too


def test_mix_splits_only_the_model_syntax() -> None:
    from vllm_lora_ext.cli.mix import _split_items

    assert _split_items(["a=0.7+b=0.3"]) == ["a=0.7", "b=0.3"]
    for whole in ("hf:org/repo@v1+build=0.5", "a=1e+0", "hf:o/r:sub+dir/x.safetensors", "a+b"):
        assert _split_items([whole]) == [whole]
    # names of the deployment config take the config's weights in the model syntax, as the server reads 'a+b'
    names = frozenset({"style", "domain"})
    assert _split_items(["style+domain"], names) == ["style", "domain"]
    assert _split_items(["style=0.7+domain"], names) == ["style=0.7", "domain"]
    for whole in ("style+other", "hf:org/repo@v1+build", "a=1e+0"):
        assert _split_items([whole], names) == [whole]


def test_mix_past_the_largest_rank_vllm_serves_is_refused_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Five rank-128 adapters mix to rank 640, which no ``--max-lora-rank`` of vLLM takes (512 at most): refused
    with the fix, not written with exit 0."""
    from factories import dense_tensors, llama_shapes, lora_config, write_adapter

    write_adapter(tmp_path / "big", dense_tensors(llama_shapes(), rank=128, seed=1), lora_config(128, 128))
    args = ["mix", *[f"{tmp_path / 'big'}=0.2"] * 5, "-o", str(tmp_path / "mix")]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "The mix has rank 640 but max_lora_rank is 512" in err and "Mix fewer adapters" in err
    assert not (tmp_path / "mix").exists()
    assert main(["mix", *[f"{tmp_path / 'big'}=0.25"] * 4, "-o", str(tmp_path / "mix")]) == 0  # 512 fits


def test_mix_refuses_an_item_with_nothing_after_its_equals_sign(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``a=$W`` with ``W`` unset reaches the CLI as ``a=``: refused, not mixed at the default weight."""
    make_dense_adapter(tmp_path / "a", rank=4, alpha=8)
    assert main(["mix", f"{tmp_path / 'a'}=", f"{tmp_path / 'a'}=0.5", "-o", str(tmp_path / "m")]) == 1
    assert "has nothing after '='. Give a weight" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_cli_version_a_commands_unknown_flag_and_the_values_note(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``--version`` answers; a misspelt flag of a command shows that command's usage, not the top level's;
    ``inspect --values`` says it read every factor when none holds NaN or infinity (it printed nothing); an
    adapter given five times is named once."""
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("vllm-lora ")
    make_dense_adapter(tmp_path / "a", rank=4, alpha=8)
    with pytest.raises(SystemExit) as done:
        main(["inspect", str(tmp_path / "a"), "--jsn"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "usage: vllm-lora inspect" in err and "unrecognized arguments: --jsn" in err
    with pytest.raises(SystemExit) as done:  # before the command's name: the top level's (it showed inspect's)
        main(["--jsn", "inspect", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "usage: vllm-lora [-h]" in err and "vllm-lora: error: unrecognized arguments" in err
    assert main(["inspect", str(tmp_path / "a"), "--values"]) == 0
    assert "every factor was read; none holds NaN or infinity" in capsys.readouterr().err
    assert main(["mix", *[f"{tmp_path / 'a'}=0.2"] * 5, "-o", str(tmp_path / "m")]) == 0
    assert capsys.readouterr().err.count("is given twice") == 1


def test_mix_with_an_mla_base_config_names_the_kv_b_proj_part_vllm_would_not_apply(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """inspect --base-config names a kv_b_proj LoRA on an MLA model as a problem; mix with the same base config
    wrote it without a word."""
    from factories import dense_tensors, lora_config, write_adapter

    attn = "model.layers.0.self_attn"
    write_adapter(tmp_path / "mla", dense_tensors({f"{attn}.kv_b_proj": (16, 64), f"{attn}.q_proj": (32, 64)}, rank=4),
                  lora_config(4, 8, ("kv_b_proj", "q_proj")))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v2", "kv_lora_rank": 16}))
    assert main(["mix", f"{tmp_path / 'mla'}=0.5", "-o", str(tmp_path / "m"),
                 "--base-config", str(tmp_path / "config.json")]) == 0
    err = capsys.readouterr().err
    assert "note: on this base model, vLLM would accept but not apply" in err and "kv_b_proj" in err
    assert main(["mix", f"{tmp_path / 'mla'}=0.5", "-o", str(tmp_path / "m2")]) == 0  # no base: nothing to say
    assert "kv_b_proj" not in capsys.readouterr().err
