"""The fused-MoE LoRA warm-up at engine start: installed once, inert without LoRA or MoE LoRA layers, and the
dummy batches it runs through vLLM's model runner (the runner itself needs a GPU, so a recording stand-in for it
is the outer boundary here; tests/gpu/test_moe_warmup.py runs the real one)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_lora_ext.integration.warmup import (
    MOE_LORA_OP_MODULE,
    has_moe_lora_layers,
    lora_kernel_variants,
    make_compile_or_warm_up_model,
    warm_up_moe_lora,
    warmup_lora_counts,
    warmup_token_counts,
)

pytestmark = pytest.mark.vllm


class _Runner:
    """Records what the warm-up asks of vLLM's GPU model runner."""

    def __init__(self, model: torch.nn.Module, *, max_loras: int | None, max_num_tokens: int = 32,
                 max_num_reqs: int = 8, specialize_active_lora: bool = False) -> None:
        self.lora_config = None if max_loras is None else type("LoRAConfig", (), {
            "max_loras": max_loras, "specialize_active_lora": specialize_active_lora})()
        self.max_num_tokens, self.max_num_reqs = max_num_tokens, max_num_reqs
        self.model = model
        self.runs: list[tuple[int, int, Any]] = []
        self.removed = 0

    def get_model(self) -> torch.nn.Module:
        return self.model

    def _dummy_run(self, num_tokens: int, cudagraph_runtime_mode: Any = None, skip_eplb: bool = False,
                   remove_lora: bool = True, num_active_loras: int = 0) -> None:
        assert remove_lora is False and skip_eplb is True
        self.runs.append((num_tokens, num_active_loras, cudagraph_runtime_mode))

    def maybe_remove_all_loras(self, lora_config: Any) -> None:
        self.removed += 1


def _moe_lora_model() -> torch.nn.Module:
    """A model holding vLLM's real FusedMoEWithLoRA class (not initialised: building one needs a GPU MoE layer)."""
    from vllm.lora.layers import FusedMoEWithLoRA

    layer = FusedMoEWithLoRA.__new__(FusedMoEWithLoRA)
    torch.nn.Module.__init__(layer)
    return torch.nn.ModuleList([torch.nn.Linear(4, 4), layer])


def test_register_twice_installs_the_warm_up_on_the_worker_once() -> None:
    from vllm_lora_ext.integration import plugin
    from vllm_lora_ext.integration.patching import PATCH_MARK, apply_patch

    plugin.register()
    plugin.register()
    import vllm.v1.worker.gpu_worker as gw

    patched = gw.Worker.compile_or_warm_up_model
    assert getattr(patched, PATCH_MARK) == "vllm.v1.worker.gpu_worker.Worker.compile_or_warm_up_model"
    assert not getattr(patched.__wrapped__, PATCH_MARK, False)
    row = next(p for p in plugin.PATCHES if p.target == "Worker.compile_or_warm_up_model")
    apply_patch(gw, row)
    assert gw.Worker.compile_or_warm_up_model is patched


def test_the_patched_warm_up_calls_vllms_warm_up_once_and_returns_its_result() -> None:
    calls: list[Any] = []
    worker = type("Worker", (), {"model_runner": _Runner(_moe_lora_model(), max_loras=None)})()
    replacement = make_compile_or_warm_up_model(lambda self: calls.append(self) or "times")
    assert replacement(worker) == "times" and calls == [worker]
    assert worker.model_runner.runs == []


def test_without_lora_the_warm_up_runs_nothing() -> None:
    runner = _Runner(_moe_lora_model(), max_loras=None)
    assert warm_up_moe_lora(runner) == 0 and runner.runs == [] and runner.removed == 0


def test_a_model_without_moe_lora_layers_is_not_warmed_up() -> None:
    runner = _Runner(torch.nn.Sequential(torch.nn.Linear(4, 4)), max_loras=4)
    assert not has_moe_lora_layers(runner.model)
    assert warm_up_moe_lora(runner) == 0 and runner.runs == []


def test_the_warm_up_runs_every_token_count_with_all_adapters_or_one_two_and_all_when_counts_specialise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config import CUDAGraphMode

    monkeypatch.delenv("VLLM_LORA_EXT_MOE_WARMUP", raising=False)
    monkeypatch.setenv("VLLM_LORA_EXT_MOE_WARMUP_TOKENS", "1, 3,48")
    # the kernels see max_loras + 1 whatever the batch holds: one run per token count (48 is over max_num_tokens;
    # a batch of n tokens holds at most n adapters)
    runner = _Runner(_moe_lora_model(), max_loras=4, max_num_tokens=32)
    assert warm_up_moe_lora(runner) == 2 and [(n, k) for n, k, _ in runner.runs] == [(1, 1), (3, 3)]
    # with specialize_active_lora they key on the count: 3 tokens run on 1, 2 and 3
    runner = _Runner(_moe_lora_model(), max_loras=4, max_num_tokens=32, specialize_active_lora=True)
    assert warm_up_moe_lora(runner) == 4
    assert [(n, k) for n, k, _ in runner.runs] == [(1, 1), (3, 1), (3, 2), (3, 3)]
    assert {mode for _, _, mode in runner.runs} == {CUDAGraphMode.NONE}  # eager: nothing captured here
    assert runner.removed == 1  # the dummy adapters leave their slots


def test_the_default_sweep_covers_decode_and_prefill_batch_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_LORA_EXT_MOE_WARMUP_TOKENS", raising=False)
    runner = _Runner(_moe_lora_model(), max_loras=1, max_num_tokens=40, max_num_reqs=4)
    warm_up_moe_lora(runner)
    assert [n for n, _, _ in runner.runs] == warmup_token_counts(4, 40)
    assert warmup_lora_counts(3) == [3] and warmup_lora_counts(3, True) == [1, 2, 3]
    assert warmup_token_counts(256, 8192)[:64] == list(range(1, 65)) and 256 in warmup_token_counts(256, 8192)
    assert {2048, 2049, 2063, 2064, 2065} <= set(warmup_token_counts(256, 8192))


def _one_shot_keys(n: int, *, max_loras: int, rank: int, block_m: Any) -> set[tuple[Any, ...]]:
    """The compile keys of vLLM 0.26-0.33's fused-MoE LoRA kernels for a batch of ``n`` tokens on the Qwen3-30B-A3B
    shape (E 128, top_k 8, hidden 2048, intermediate 768, 132 SMs, no tensor parallelism), transcribed from
    ``fused_moe_lora_op.py`` (path choice, constexprs, the integer arguments Triton specialises: 1, divisible by 16,
    other) and ``punica_gpu.py`` (naive assignment, padded length); ``block_m(n)``: the base MoE config's."""
    def spec(v: int) -> str:
        return "1" if v == 1 else "D" if v % 16 == 0 else ""

    e, top_k, hidden, inter, sms = 128, 8, 2048, 768, 132
    naive, grid, keys = n * top_k * 8 <= e * max_loras, max_loras + 1, set()
    for op, k, n_out, slices in (("w13", hidden, inter, 2), ("w2", inter, hidden, 1)):
        pairs = n * top_k
        if naive and rank <= 64 and pairs * rank <= 1024:  # the small-batch kernel
            tiles, work = -(-n_out // 128), pairs * slices
            per = 1 if work * tiles <= 2 * sms else min(-(-(work * tiles) // (2 * sms)), tiles)
            keys.add(("small", op, spec(work * -(-tiles // per)), spec(work), spec(per), spec(-(-tiles // per))))
            continue
        bm = 16 if naive else block_m(n)
        padded = pairs if naive else (pairs * bm if pairs < e else pairs + e * (bm - 1))
        per_lora = 1 if naive else grid
        blocks = max((pairs if naive else -(-padded // bm)) * slices * per_lora, 1)  # naive: a block per pair
        budget = int(1.5 / (k / (k + n_out))) + 1
        npid = 1 if blocks >= int(1.5 * sms) else min(max(1, min(16, (2 * sms + blocks - 1) // blocks)), budget)
        npid = max(1, min(npid, n_out // 128))
        keys.add(("one_shot", op, naive, bm, npid, spec(pairs), spec(0 if naive else padded),
                  spec(0 if naive else -(-padded // bm))))
    return keys


@pytest.mark.parametrize("max_loras, rank, max_num_seqs, max_tokens", [(3, 64, 256, 8192), (16, 32, 32, 2048),
                                                                         (1, 16, 16, 256)])
def test_the_sweep_reaches_every_fused_moe_lora_kernel_key_a_batch_can_need(
        max_loras: int, rank: int, max_num_seqs: int, max_tokens: int) -> None:
    import json

    import vllm

    path = (Path(vllm.__file__).parent / "model_executor/layers/fused_moe/configs"
            / "E=128,N=768,device_name=NVIDIA_H200.json")
    table = {int(m): c["BLOCK_SIZE_M"] for m, c in json.loads(path.read_text()).items()}

    def block_m(n: int) -> int:  # vLLM's nearest-key lookup
        return table[min(table, key=lambda m: abs(m - n))]

    def keys(n: int) -> set[tuple[Any, ...]]:
        return _one_shot_keys(n, max_loras=max_loras, rank=rank, block_m=block_m)

    needed = {key: n for n in range(max_tokens, 0, -1) for key in keys(n)}  # each key's smallest N
    warmed = set().union(*(keys(n) for n in warmup_token_counts(max_num_seqs, max_tokens)))
    assert {k: n for k, n in needed.items() if k not in warmed} == {}
    # the sweep before r23 (2^k, 2^k + 1, 3·2^(k-1)) missed some, e.g. N = 2,050 (seen compiling on an H200)
    old = set(range(1, min(max_num_seqs, 64) + 1)) | {max_num_seqs, max_tokens}
    old |= {n for k in range(2, 15) for n in (2**k, 2**k + 1, 3 * 2 ** (k - 1)) if n <= max_tokens}
    assert set(needed) - set().union(*(keys(n) for n in old))


def _h200_block_m() -> Any:
    import json

    import vllm

    path = (Path(vllm.__file__).parent / "model_executor/layers/fused_moe/configs"
            / "E=128,N=768,device_name=NVIDIA_H200.json")
    table = {int(m): c["BLOCK_SIZE_M"] for m, c in json.loads(path.read_text()).items()}
    return lambda n: table[min(table, key=lambda m: abs(m - n))]  # vLLM's nearest-key lookup


def _qwen3_30b_shape(max_loras: int, rank: int, pairs_max_rank: int = 0) -> Any:
    from vllm_lora_ext.integration.warmup_sweep import MoEOpShape, MoESweepShape

    ops = (MoEOpShape(2048, 768, 2, 128, False), MoEOpShape(768, 2048, 1, 128, True))
    return MoESweepShape(ops, 8, 128, 128, False, False, max_loras, rank, 132, pairs_max_rank=pairs_max_rank)


@pytest.mark.parametrize("max_loras, rank", [(3, 64), (16, 32), (1, 16)])
def test_the_plugins_replay_splits_token_counts_into_the_same_kernel_keys_as_the_transcription_here(
        max_loras: int, rank: int) -> None:
    from vllm_lora_ext.integration.warmup_sweep import variant_keys

    block_m = _h200_block_m()
    pairs: set[tuple[frozenset[Any], frozenset[Any]]] = set()
    for n in range(1, 4097):
        here = frozenset(_one_shot_keys(n, max_loras=max_loras, rank=rank, block_m=block_m))
        pairs.add((here, frozenset(variant_keys(n, _qwen3_30b_shape(max_loras, rank), lambda op, m: block_m(m),
                                                [max_loras + 1]))))
    # the same partition of 1..4096: each key set here goes with one key set of the plugin's, and back
    assert len({a for a, _ in pairs}) == len({b for _, b in pairs}) == len(pairs) > 20


def test_on_a_small_expert_count_the_shape_aware_counts_reach_the_variants_the_fixed_sweep_misses() -> None:
    """tests/gpu/test_moe_warmup.py's tiny Qwen3-MoE (8 experts, top-2): on an H200 its random batches of 36, 60,
    84, 140 and 148 tokens compiled variants after the fixed sweep's warm-up (r43); the shape-aware counts reach
    every key of 1..256 tokens."""
    from vllm_lora_ext.integration.warmup_sweep import MoEOpShape, MoESweepShape, token_counts_for_keys, variant_keys

    ops = (MoEOpShape(256, 96, 2, 8, False), MoEOpShape(96, 256, 1, 8, True))
    tiny = MoESweepShape(ops, 2, 8, 8, False, False, 2, 16, 132, pairs_max_rank=32)

    def block_m(op: int, n: int) -> int:  # the block sizes those launches had
        return 16 if n <= 32 else 32 if n <= 96 else 64

    def keys(counts: Any) -> set[Any]:
        return set().union(*(variant_keys(n, tiny, block_m, [3]) for n in counts))

    fixed = warmup_token_counts(16, 256)
    missed = [n for n in (36, 60, 84, 140, 148) if keys([n]) - keys(fixed)]
    assert missed == [36, 60, 84, 140, 148]
    extra = token_counts_for_keys(tiny, 256, block_m, [3], covered=fixed)
    assert keys(range(1, 257)) == keys(fixed + extra) and len(extra) < 10


def test_the_warm_up_adds_the_shape_aware_counts_to_the_sweep_or_runs_the_sweep_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lora_ext.integration import warmup
    from vllm_lora_ext.integration.warmup_sweep import MoEOpShape, MoESweepShape

    monkeypatch.delenv("VLLM_LORA_EXT_MOE_WARMUP_TOKENS", raising=False)
    ops = (MoEOpShape(256, 96, 2, 8, False), MoEOpShape(96, 256, 1, 8, True))
    tiny = MoESweepShape(ops, 2, 8, 8, False, False, 2, 16, 132)
    monkeypatch.setattr(warmup, "_sweep_shape", lambda runner: (tiny, lambda op, n: 16 if n <= 32 else 32))
    runner = _Runner(_moe_lora_model(), max_loras=2, max_num_tokens=64, max_num_reqs=16)
    warm_up_moe_lora(runner)
    ran = [n for n, _, _ in runner.runs]
    assert 36 in ran and 36 not in warmup_token_counts(16, 64) and set(warmup_token_counts(16, 64)) < set(ran)
    assert ran == sorted(ran)
    # a layer that cannot be read (here: vLLM's class, never initialised) leaves the fixed sweep, with a warning
    monkeypatch.undo()
    monkeypatch.delenv("VLLM_LORA_EXT_MOE_WARMUP_TOKENS", raising=False)
    runner = _Runner(_moe_lora_model(), max_loras=2, max_num_tokens=64, max_num_reqs=16)
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    warmup.logger.addHandler(handler)
    try:
        warm_up_moe_lora(runner)
    finally:
        warmup.logger.removeHandler(handler)
    assert [n for n, _, _ in runner.runs] == warmup_token_counts(16, 64)
    assert any("kernel variants not worked out" in m and "fixed sweep runs alone" in m for m in seen), seen


def test_the_warm_up_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_LORA_EXT_MOE_WARMUP", "0")
    runner = _Runner(_moe_lora_model(), max_loras=4)
    assert warm_up_moe_lora(runner) == 0 and runner.runs == []


def test_bad_warm_up_token_counts_are_refused_naming_the_setting_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_LORA_EXT_MOE_WARMUP_TOKENS", "1,two,0")
    with pytest.raises(ValueError, match=r"VLLM_LORA_EXT_MOE_WARMUP_TOKENS='1,two,0'.*unset it for the default"):
        warm_up_moe_lora(_Runner(_moe_lora_model(), max_loras=2))


def test_kernel_variant_counts_name_the_lora_kernels_or_nothing_before_vllm_loads_them() -> None:
    counts = lora_kernel_variants(modules=(MOE_LORA_OP_MODULE,))
    # On a machine without a GPU vLLM's Triton placeholder stands in for the kernels: no counts, and no error.
    assert all(name.startswith("_fused_moe_lora") and n >= 0 for name, n in counts.items())
    assert all(("lora" in name) and n >= 0 for name, n in lora_kernel_variants().items())


class _LogitsRunner(_Runner):
    """A runner whose dummy runs return (hidden states, the sampled rows), as vLLM 0.26-0.33's do, and whose model
    computes logits through vLLM's real ``LogitsProcessorWithLoRA`` class (not initialised: that needs a GPU)."""

    def __init__(self, fail: bool = False) -> None:
        from vllm.lora.layers import LogitsProcessorWithLoRA

        logits = LogitsProcessorWithLoRA.__new__(LogitsProcessorWithLoRA)
        torch.nn.Module.__init__(logits)
        model = torch.nn.ModuleList([_moe_lora_model(), logits])
        self.computed: list[int] = []

        def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
            if fail:
                raise RuntimeError("no logits here")
            self.computed.append(hidden.shape[0])
            return hidden

        model.compute_logits = compute_logits  # type: ignore[assignment]
        super().__init__(model, max_loras=2, max_num_tokens=32, max_num_reqs=4)

    def _dummy_run(self, num_tokens: int, cudagraph_runtime_mode: Any = None,  # type: ignore[override]
                   skip_eplb: bool = False, remove_lora: bool = True,
                   num_active_loras: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        super()._dummy_run(num_tokens, cudagraph_runtime_mode, skip_eplb, remove_lora, num_active_loras)
        hidden = torch.zeros(num_tokens, 4)
        return hidden, hidden[: min(num_tokens, self.max_num_reqs)]


def test_each_dummy_batch_also_computes_its_logits_with_its_loras_active(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_LORA_EXT_MOE_WARMUP_TOKENS", "1,3,16")
    runner = _LogitsRunner()
    assert warm_up_moe_lora(runner) == 3  # 1 token x 1 adapter, 3 x 2, 16 x 2
    assert runner.computed == [1, 3, 4] and runner.removed == 1  # the sampled rows: one per dummy request


def test_with_several_tensor_or_pipeline_ranks_the_logits_are_left_to_the_first_step(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # the logits are gathered over the ranks there: a warm-up that fails on one rank could strand the others
    monkeypatch.setenv("VLLM_LORA_EXT_MOE_WARMUP_TOKENS", "1,3")
    for tp, pp in ((2, 1), (1, 2)):
        runner = _LogitsRunner()
        sizes = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}
        runner.parallel_config = type("ParallelConfig", (), sizes)()
        with caplog.at_level("INFO", logger="vllm_lora_ext.integration.warmup"):
            assert warm_up_moe_lora(runner) == 2
        assert runner.computed == [] and "logits not with tensor or pipeline parallelism" in caplog.text


def test_a_logits_warm_up_that_fails_is_logged_once_and_the_rest_still_runs(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("VLLM_LORA_EXT_MOE_WARMUP_TOKENS", "1,3,16")
    runner = _LogitsRunner(fail=True)
    with caplog.at_level("WARNING", logger="vllm_lora_ext.integration.warmup"):
        assert warm_up_moe_lora(runner) == 3
    assert caplog.text.count("not warming up the LoRA logits kernels (skipped (RuntimeError: no logits here))") == 1


def test_a_runner_whose_dummy_run_takes_no_loras_is_left_alone_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    class _OtherRunner(_Runner):
        def _dummy_run(self, num_tokens: int) -> None:  # type: ignore[override]
            raise AssertionError("must not be called")

    runner = _OtherRunner(_moe_lora_model(), max_loras=2)
    with caplog.at_level("WARNING", logger="vllm_lora_ext.integration.warmup"):
        assert warm_up_moe_lora(runner) == 0
    assert "does not take dummy LoRAs" in caplog.text


def test_vllms_gpu_model_runner_takes_the_warm_up_arguments() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_lora_ext.integration._compat import runner_dummy_runs_with_loras

    assert runner_dummy_runs_with_loras(GPUModelRunner)  # the class: its _dummy_run's signature, no GPU needed


_LOAD_PATH_PROBE = """
import sys, torch
from vllm_lora_ext.integration.warmup import LOAD_PATH_MODULES, make_compile_or_warm_up_model
lora = sys.argv[1] == "lora"
runner = type("Runner", (), {"lora_config": object() if lora else None,
                             "get_model": lambda self: torch.nn.Linear(2, 2)})()
worker = type("Worker", (), {"model_runner": runner})()
assert not any(m in sys.modules for m in LOAD_PATH_MODULES), [m for m in LOAD_PATH_MODULES if m in sys.modules]
assert make_compile_or_warm_up_model(lambda self: "warmed")(worker) == "warmed"
print(sorted(m for m in LOAD_PATH_MODULES if m in sys.modules))
"""


@pytest.mark.parametrize("lora", [True, False])
def test_a_lora_worker_imports_the_adapter_load_path_while_it_starts(lora: bool) -> None:
    """The first add_lora in a fresh worker does not pay for importing the loader (about 0.1 s on the dev VM);
    a worker without LoRA imports none of it. A fresh process, so nothing else imported the modules first."""
    import subprocess
    import sys

    from vllm_lora_ext.integration.warmup import LOAD_PATH_MODULES

    out = subprocess.run([sys.executable, "-c", _LOAD_PATH_PROBE, "lora" if lora else "none"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(sorted(LOAD_PATH_MODULES) if lora else [])


def test_an_offline_engine_imports_source_resolution_when_vllm_builds_it() -> None:
    import subprocess
    import sys

    probe = ("import sys\nfrom vllm_lora_ext.integration import plugin\nplugin.register()\n"
             "assert 'vllm_lora_ext.resolve' not in sys.modules\nimport vllm.v1.engine.llm_engine\n"
             "print('vllm_lora_ext.resolve' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True"
