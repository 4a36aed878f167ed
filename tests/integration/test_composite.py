"""Weighted mixes built by the worker loader: exact against a dense oracle, and through vLLM's CPU punica wrapper."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from factories import make_peft_adapter, tiny_llama
from vllm_lora_ext.errors import AdapterCompatibilityError
from vllm_lora_ext.mixing import MixComponent, MixSpec

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("mix")
    return {
        "a": make_peft_adapter(tiny_llama(), d / "a", targets=["q_proj", "o_proj", "down_proj"], rank=4, alpha=8, seed=1),
        "b": make_peft_adapter(tiny_llama(), d / "b", targets=["q_proj", "v_proj"], rank=8, alpha=8, seed=2,
                               use_rslora=True),
    }


def _dense_oracle(folder: Path) -> dict[str, torch.Tensor]:
    """ΔW = s·B·A per module, straight from the files (an independent code path)."""
    cfg = json.loads((folder / "adapter_config.json").read_text())
    t = load_file(str(folder / "adapter_model.safetensors"))
    r, alpha = cfg["r"], cfg["lora_alpha"]
    s = alpha / r**0.5 if cfg.get("use_rslora") else alpha / r
    out = {}
    for k, a in t.items():
        if k.endswith("lora_A.weight"):
            mod = k[len("base_model.model."):-len(".lora_A.weight")]
            out[mod] = s * t[k.replace("lora_A", "lora_B")].float() @ a.float()
    return out


def _load(worker_manager: Any, spec: MixSpec) -> Any:
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.integration import plugin
    from vllm_lora_ext.integration.composite import clear_component_cache

    plugin.register()
    import vllm.lora.worker_manager as wm

    clear_component_cache()
    return wm.WorkerLoRAManager._load_adapter(worker_manager, LoRARequest(lora_name=spec.lora_name,
                                                                          lora_int_id=1 << 30,
                                                                          lora_path=spec.lora_path))


@pytest.mark.parametrize("weights", [(0.7, 0.3), (1.0, -0.5)])
def test_composite_equals_weighted_sum_of_deltas(worker_manager: Any, adapters: dict[str, Path],
                                                 weights: tuple[float, float]) -> None:
    spec = MixSpec((MixComponent("a", str(adapters["a"]), weights[0]), MixComponent("b", str(adapters["b"]), weights[1])))
    composite = _load(worker_manager, spec)
    oa, ob = _dense_oracle(adapters["a"]), _dense_oracle(adapters["b"])
    assert sorted(composite.loras) == sorted(set(oa) | set(ob))  # partial overlap: union of modules
    for name, w in composite.loras.items():
        expected = weights[0] * oa.get(name, 0) + weights[1] * ob.get(name, 0)
        assert w.scaling == 1.0
        torch.testing.assert_close(w.lora_b @ w.lora_a, expected, rtol=1e-4, atol=1e-5)
        assert w.lora_a.shape[0] == (4 if name in oa else 0) + (8 if name in ob else 0)


def test_composite_through_vllms_cpu_punica_wrapper_equals_the_dense_reference(worker_manager: Any,
                                                                               adapters: dict[str, Path]) -> None:
    from vllm.lora.layers.utils import LoRAMapping
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    spec = MixSpec((MixComponent("a", str(adapters["a"]), 0.7), MixComponent("b", str(adapters["b"]), 0.3)))
    composite = _load(worker_manager, spec)
    name = "model.layers.1.self_attn.q_proj"
    w = composite.loras[name]
    max_rank, slots, tokens = 16, 2, 6
    a_stacked = torch.zeros(slots, 1, max_rank, w.lora_a.shape[1])
    b_stacked = torch.zeros(slots, 1, w.lora_b.shape[0], max_rank)
    a_stacked[0, 0, : w.lora_a.shape[0]] = w.lora_a  # slot 0 holds the composite (zero-padded to max rank)
    b_stacked[0, 0, :, : w.lora_b.shape[1]] = w.lora_b
    punica = PunicaWrapperCPU(64, 4, device="cpu")
    # every token uses the composite's slot (vLLM 0.26's CPU ops mis-handle "no LoRA" (-1) tokens)
    punica.update_metadata(LoRAMapping((7,) * tokens, (7,) * tokens, is_prefill=True), [7, None], slots + 1, 256)
    x = torch.randn(tokens, w.lora_a.shape[1], generator=torch.Generator().manual_seed(0))
    y = torch.zeros(tokens, w.lora_b.shape[0])
    punica.add_lora_linear(y, x, (a_stacked,), (b_stacked,), 1.0, (w.lora_b.shape[0],))
    dense = 0.7 * _dense_oracle(adapters["a"])[name] + 0.3 * _dense_oracle(adapters["b"])[name]
    torch.testing.assert_close(y, x @ dense.T, rtol=1e-4, atol=1e-4)


def test_the_component_cache_holds_built_adapters_by_checkpoint_key_and_a_second_mix_builds_nothing(
        worker_manager: Any, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    import math

    import vllm.lora.worker_manager as wm
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.building import BuiltAdapter, MappedAdapter, ModuleKeys
    from vllm_lora_ext.integration import composite, loader

    def mix(wa: float, wb: float) -> MixSpec:
        return MixSpec((MixComponent("a", str(adapters["a"]), wa), MixComponent("b", str(adapters["b"]), wb)))

    first = _load(worker_manager, mix(0.7, 0.3))  # the cache starts empty
    cached = {source: entry for (_, source), entry in composite._CACHE.items()}
    assert sorted(cached) == sorted([str(adapters["a"]), str(adapters["b"])])
    for folder, scaling in ((adapters["a"], 8 / 4), (adapters["b"], 8 / math.sqrt(8))):
        entry = cached[str(folder)]
        assert type(entry) is MappedAdapter and type(entry.built) is BuiltAdapter and entry.built.moe == {}
        oracle = load_file(str(folder / "adapter_model.safetensors"))
        assert sorted(entry.built.dense) == sorted(oracle)  # checkpoint keys, no vLLM object anywhere
        assert set(entry.modules) <= set(first.loras) and len(entry.modules) * 2 == len(oracle)
        for name, keys in entry.modules.items():
            assert type(keys) is ModuleKeys and keys.scaling == scaling
            assert keys.key_a == f"base_model.model.{name}.lora_A.weight"
            assert keys.key_b == keys.key_a.replace("lora_A", "lora_B")
            assert torch.equal(entry.built.dense[keys.key_a], oracle[keys.key_a])

    def no_build(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a cached component was built again")

    monkeypatch.setattr(loader, "_load_adapter_model", no_build)
    spec = mix(0.5, -0.5)
    second = wm.WorkerLoRAManager._load_adapter(worker_manager, LoRARequest(spec.lora_name, 1 << 30, spec.lora_path))
    oa, ob = _dense_oracle(adapters["a"]), _dense_oracle(adapters["b"])
    for name, w in second.loras.items():
        torch.testing.assert_close(w.lora_b @ w.lora_a, 0.5 * oa.get(name, 0) - 0.5 * ob.get(name, 0),
                                   rtol=1e-4, atol=1e-5)
    composite.clear_component_cache()


def test_mix_over_max_lora_rank_names_the_ranks_and_the_setting(worker_manager: Any, adapters: dict[str, Path]) -> None:
    spec = MixSpec((MixComponent("a", str(adapters["a"]), 0.5), MixComponent("b", str(adapters["b"]), 0.5),
                    MixComponent("b2", str(adapters["b"]) + "/", 0.5)))
    with pytest.raises(AdapterCompatibilityError, match=r"needs rank 20 .* max_lora_rank is 16.*--max-lora-rank 32"):
        _load(worker_manager, spec)


def test_a_mix_over_the_rank_budget_is_refused_reading_nothing_once_its_adapters_were_built(
        worker_manager: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """16 registered rank-4 adapters in one mix at max_lora_rank 16: each request (new weights: a new mix, whose
    refusal is not shared) read all 16 whole adapters again before the budget refused it (r43 attacker). The
    first request still reads them; later ones are refused from the ranks known, reading none."""
    from vllm_lora_ext.integration import composite

    paths = [make_peft_adapter(tiny_llama(), tmp_path / f"a{i}", targets=["q_proj"], rank=4, alpha=8, seed=i)
             for i in range(16)]
    read: list[str] = []
    real = composite._component
    monkeypatch.setattr(composite, "_component", lambda m, c, load: read.append(c.name) or real(m, c, load))
    composite.clear_component_cache()
    for weight in (0.5, 0.25, 0.125):
        spec = MixSpec(tuple(MixComponent(f"a{i}", str(p), weight) for i, p in enumerate(paths)))
        with pytest.raises(AdapterCompatibilityError, match=r"needs rank 64 .* max_lora_rank is 16: model.layers.0.self_attn.q_proj needs 64 \(a0 r=4"):
            _load(worker_manager, spec)
    assert sorted(read) == sorted(f"a{i}" for i in range(16))  # the first request only
    read.clear()
    (paths[0] / "adapter_model.safetensors").write_bytes((paths[1] / "adapter_model.safetensors").read_bytes())
    spec = MixSpec((MixComponent("a0", str(paths[0]), 1.0), MixComponent("a2", str(paths[2]), 1.0)))
    _load(worker_manager, spec)  # rank 8 fits: a file changed since is read again, the other is cached
    composite.clear_component_cache()


@pytest.mark.usefixtures("build_dir")
def test_a_mix_whose_components_build_side_by_side_in_the_build_process_equals_one_built_in_the_worker(
        worker_manager: Any, adapters: dict[str, Path], tmp_path: Path, jobs_sent: list[str]) -> None:
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.integration import build_process
    from vllm_lora_ext.integration.composite import clear_component_cache
    from vllm_lora_ext.integration.loader import build_composite

    c = make_peft_adapter(tiny_llama(), tmp_path / "c", targets=["q_proj", "up_proj"], rank=2, alpha=4, seed=3)
    spec = MixSpec((MixComponent("a", str(adapters["a"]), 0.7), MixComponent("b", str(adapters["b"]), -0.2),
                    MixComponent("c", str(c), 1.5)))
    here = _load(worker_manager, spec)  # components built in this thread
    build_process._POOL.get()  # started, so the components are not built in this process meanwhile
    clear_component_cache()
    there = build_composite(worker_manager, LoRARequest(lora_name=spec.lora_name, lora_int_id=5,
                                                        lora_path=spec.lora_path), separate_process=True)
    assert sorted(jobs_sent) == ["a", "b", "c"]
    assert sorted(there.loras) == sorted(here.loras)
    for name, w in here.loras.items():
        assert torch.equal(there.loras[name].lora_a, w.lora_a) and torch.equal(there.loras[name].lora_b, w.lora_b)


def test_a_mix_built_into_kept_memory_equals_one_built_into_fresh_memory_and_leaves_the_last_one_alone(
        worker_manager: Any, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from vllm_lora_ext.transport import arena as hostmem
    from vllm_lora_ext.constants import ENV_HOST_ARENA_MIN, ENV_HOST_ARENAS, ENV_HOST_SPARE

    def mix(w: float) -> MixSpec:
        return MixSpec((MixComponent("a", str(adapters["a"]), w), MixComponent("b", str(adapters["b"]), 1 - w)))

    def factors(model: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {n: (w.lora_a, w.lora_b) for n, w in model.loras.items()}

    monkeypatch.setenv(ENV_HOST_ARENAS, "0")
    fresh = [factors(_load(worker_manager, mix(w))) for w in (0.25, 0.6)]
    monkeypatch.setenv(ENV_HOST_ARENAS, "1")
    monkeypatch.setenv(ENV_HOST_ARENA_MIN, "0")
    monkeypatch.setenv(ENV_HOST_SPARE, str(64 << 20))
    hostmem.clear_spare()
    first = factors(_load(worker_manager, mix(0.25)))  # fresh memory; a spare of its size is made after it
    kept_before = first["model.layers.0.self_attn.q_proj"][0].clone()
    for _ in range(500):
        if not hostmem._SPARE._preparing:
            break
        time.sleep(0.01)
    taken = hostmem._SPARE.reused
    second = factors(_load(worker_manager, mix(0.6)))
    assert hostmem._SPARE.reused == taken + 1  # the second mix went into the prepared memory
    for got, want in ((first, fresh[0]), (second, fresh[1])):
        assert list(got) == list(want)
        for name in want:
            for x, y in zip(got[name], want[name]):
                assert x.dtype == y.dtype and torch.equal(x, y)
    assert torch.equal(first["model.layers.0.self_attn.q_proj"][0], kept_before)  # not the memory the first holds
    hostmem.clear_spare()


def test_a_new_mix_after_a_component_folder_is_written_over_reads_the_new_bytes_not_the_cached_ones(
        worker_manager: Any, tmp_path: Path) -> None:
    """One client's adapter cached as a mix component, then the folder written over with another's: a new mix
    naming that folder is built from the bytes there now, never from the cache of the old ones."""
    import shutil

    import vllm.lora.worker_manager as wm
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.integration import composite

    alice = make_peft_adapter(tiny_llama(), tmp_path / "alice", targets=["q_proj"], rank=4, alpha=8, seed=1)
    bob = make_peft_adapter(tiny_llama(), tmp_path / "bob", targets=["q_proj"], rank=4, alpha=8, seed=2)
    upload = tmp_path / "upload"
    shutil.copytree(alice, upload)

    def mix(w: float) -> Any:
        spec = MixSpec((MixComponent("up", str(upload), w),))
        return wm.WorkerLoRAManager._load_adapter(worker_manager, LoRARequest(spec.lora_name, 1 << 30, spec.lora_path))

    def deltas(lora: Any) -> dict[str, torch.Tensor]:
        return {name: w.lora_b @ w.lora_a for name, w in lora.loras.items()}

    first = deltas(_load(worker_manager, MixSpec((MixComponent("up", str(upload), 1.0),))))  # alice's, cached
    assert composite._CACHE
    shutil.rmtree(upload)
    shutil.copytree(bob, upload)  # written over: another adapter at the same path
    oracle = _dense_oracle(bob)
    second = deltas(mix(0.5))
    assert sorted(second) == sorted(oracle) == sorted(first)
    for name, d in second.items():
        torch.testing.assert_close(d, 0.5 * oracle[name], rtol=1e-4, atol=1e-5)  # bob's bytes, not alice's
        assert not torch.allclose(0.5 * first[name], 0.5 * oracle[name], rtol=1e-3, atol=1e-4)  # (the control)
    composite.clear_component_cache()
