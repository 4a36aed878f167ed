"""The plugin's fused-MoE LoRA pair path on the GPU, through vLLM's own ``PunicaWrapperGPU.add_lora_w13`` and
``add_lora_w2`` (Qwen3-30B-A3B's MoE shape, the tuner's ``Step``): batches vLLM assigns pair by pair give the dense
fp32 reference as closely as vLLM's kernel does (``VLLM_LORA_EXT_KERNEL_CONFIGS=0``), the path is taken for them
and not for others, and a launch replayed from a CUDA graph gives the eager launch's outputs bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kernel_tables import moe_lora_reference, moe_tuner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _shapes() -> list[Any]:
    shape = moe_tuner().Shape
    # (slots, tokens, rank): pair by pair at 32 decode tokens with 16 slots, ranks 16 and 32, 16 tokens at rank 32,
    # 12 tokens with 8 slots
    return [shape(16, 32, 16), shape(16, 32, 32), shape(16, 16, 32), shape(8, 12, 16)]


@pytest.fixture()
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The plugin registered (its patch on ``add_lora_fused_moe``), and a count of the pair path's launches."""
    from vllm_lora_ext.integration import moe_pairs, plugin

    plugin.register()
    import vllm.lora.punica_wrapper.punica_gpu  # noqa: F401  (the patch applies as vLLM imports it)

    calls = [0]
    real = moe_pairs.moe_lora_pairs

    def counting(*args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        real(*args, **kwargs)

    monkeypatch.setattr(moe_pairs, "moe_lora_pairs", counting)
    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    return calls


def _error(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> list[float]:
    return [float((g - w).abs().max()) for g, w in zip(got, want)]


@pytest.mark.parametrize("index", range(4))
def test_pair_path_gives_the_fp32_reference_as_closely_as_vllms_kernel(
        index: int, tmp_path: Path, counted: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lora_ext.kernel_configs import file_stem

    shape = _shapes()[index]
    step = moe_tuner().Step(shape, tmp_path, file_stem(torch.cuda.get_device_name()))
    for label in step.mappings:
        monkeypatch.setenv("VLLM_LORA_EXT_KERNEL_CONFIGS", "0")
        before = counted[0]
        stock = step.output(None, label)
        assert counted[0] == before  # vLLM's kernel
        monkeypatch.delenv("VLLM_LORA_EXT_KERNEL_CONFIGS")
        ours = step.output(None, label)
        assert counted[0] == before + 2  # w13 and w2 through the pair path
        ref = moe_lora_reference(step, label)
        for name, o, s, r, bound in zip(("w13", "w2"), ours, stock, ref, _error(stock, ref)):
            step_bf16 = float(r.abs().max()) * 2 ** -7
            assert float((o - r).abs().max()) <= bound + step_bf16, f"{shape} {label} {name}"
            torch.testing.assert_close(o, s, rtol=2e-2, atol=step_bf16, msg=f"{shape} {label} {name} against vLLM")
    # the control: another label's reference is far off
    other = moe_lora_reference(step, "one" if label == "spread" else "spread")
    assert max(_error(ours, other)) > 10 * max(_error(ours, ref))


def test_pair_path_is_not_taken_for_batches_vllm_sorts_its_small_batch_kernel_takes_or_of_rank_64(
        tmp_path: Path, counted: list[int]) -> None:
    from vllm_lora_ext.kernel_configs import file_stem

    shape = moe_tuner().Shape
    for s in (shape(4, 64, 16), shape(16, 512, 16), shape(4, 8, 16), shape(1, 1, 16), shape(16, 32, 64)):
        step = moe_tuner().Step(s, tmp_path, file_stem(torch.cuda.get_device_name()))
        before = counted[0]
        step.output(None, "spread")
        assert counted[0] == before, s


def test_a_captured_pair_path_replays_the_eager_outputs_bit_for_bit(tmp_path: Path, counted: list[int]) -> None:
    from vllm_lora_ext.kernel_configs import file_stem

    step = moe_tuner().Step(_shapes()[0], tmp_path, file_stem(torch.cuda.get_device_name()))
    for label in step.mappings:
        eager = step.output(None, label)  # also makes the slots' address tables, outside the capture
        before = counted[0]
        graph = torch.cuda.CUDAGraph()
        step.y13.zero_()
        step.y2.zero_()
        with torch.cuda.graph(graph):
            step.launch()
        assert counted[0] == before + 2
        step.y13.zero_()
        step.y2.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(step.y13.float(), eager[0]) and torch.equal(step.y2.float(), eager[1]), label


def _r16_adapters_in_r32_slots(tmp_path: Path) -> tuple[Any, torch.Tensor]:
    """A rank-32 layer step whose slots hold rank-16 adapters (zeros past row 16, as vLLM's set_lora leaves them),
    and its punica wrapper's live-rank table."""
    from vllm_lora_ext.integration import slot_ranks
    from vllm_lora_ext.kernel_configs import file_stem

    shape = moe_tuner().Shape(16, 32, 32)
    step = moe_tuner().Step(shape, tmp_path, file_stem(torch.cuda.get_device_name()))
    for a in (*step.w13_a, *step.w2_a):
        a[:, :, 16:, :].zero_()
    for b in (*step.w13_b, *step.w2_b):
        b[..., 16:].zero_()
    return step, slot_ranks.rank_table(step.punica, shape.slots, "cuda")


def test_the_live_rank_table_reads_fewer_rows_and_gives_the_same_outputs_bit_for_bit(
        tmp_path: Path, counted: list[int]) -> None:
    """Rank-16 adapters in rank-32 slots (zeros past row 16, as vLLM's set_lora leaves them): the pair path told so
    by the slots' live-rank table gives the outputs of the path that reads every row, bit for bit, and the fp32
    reference; the control, a table saying 8, changes them (the table is read)."""
    from vllm_lora_ext.integration import slot_ranks

    step, table = _r16_adapters_in_r32_slots(tmp_path)
    for label in step.mappings:
        table.fill_(slot_ranks.ALL_ROWS)
        before = counted[0]
        every_row = step.output(None, label)
        table.fill_(16)
        live = step.output(None, label)
        assert counted[0] == before + 4
        assert all(torch.equal(x, y) for x, y in zip(live, every_row)), label
        ref = moe_lora_reference(step, label)
        for o, r in zip(live, ref):
            assert float((o - r).abs().max()) <= float(r.abs().max()) * 2 ** -6, label
        table.fill_(8)
        short = step.output(None, label)
        assert max(_error(short, every_row)) > 0.1 * max(float(r.abs().max()) for r in ref), label


def test_a_captured_pair_path_reads_the_live_rank_table_as_it_is_at_each_replay(
        tmp_path: Path, counted: list[int]) -> None:
    """A CUDA graph captured with the table reads the entries written after the capture (as activations write
    them between steps): rank-16 adapters in rank-32 slots replay the every-row outputs with 16 or `ALL_ROWS`, and
    other outputs with 8 (the control)."""
    from vllm_lora_ext.integration import slot_ranks

    step, table = _r16_adapters_in_r32_slots(tmp_path)
    table.fill_(slot_ranks.ALL_ROWS)
    eager = step.output(None, "spread")  # also makes the slots' address tables, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.launch()
    for entry, same in ((16, True), (8, False), (slot_ranks.ALL_ROWS, True)):
        table.fill_(entry)
        step.y13.zero_()
        step.y2.zero_()
        graph.replay()
        torch.cuda.synchronize()
        replayed = (step.y13.float(), step.y2.float())
        assert all(torch.equal(r, e) for r, e in zip(replayed, eager)) is same, entry


def _new_inputs(step: Any, seed: int) -> None:
    """New activations in place (the same addresses, so a captured graph reads them): a kernel that read partials or
    outputs left by the run before would then give that run's bits, not these inputs'."""
    gen = torch.Generator(device=step.x.device).manual_seed(seed)
    for t in (step.x, step.x2):  # (the Step's own scale)
        t.copy_(torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32).to(t.dtype))


@pytest.mark.parametrize("index", [0, 1])
def test_programmatic_dependent_launch_changes_no_bit_eager_or_replayed(
        index: int, tmp_path: Path, counted: list[int], monkeypatch: pytest.MonkeyPatch,
        request: pytest.FixtureRequest) -> None:
    """On SM90 and later the pair kernels launch with PDL (the expand reads its B beside the shrink and waits for it
    before reading the partials). For new inputs before every run, each launch with PDL (eager, and replayed from
    one CUDA graph) gives the bits of an eager launch without it (vLLM's ``VLLM_LORA_DISABLE_PDL``) on the same
    inputs: a missing wait would read the partials of the run before, made from other inputs. r16 takes the
    expand's one pass, r32 its passes."""
    from vllm.lora.ops.triton_ops.utils import supports_pdl

    from vllm_lora_ext.integration import kernels
    from vllm_lora_ext.kernel_configs import file_stem

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs SM90 or later")
    request.addfinalizer(supports_pdl.cache_clear)  # vLLM caches its answer per process: none of ours outlives us

    def without_pdl(label: str) -> tuple[torch.Tensor, torch.Tensor]:
        monkeypatch.setenv("VLLM_LORA_DISABLE_PDL", "1")
        supports_pdl.cache_clear()
        assert not kernels._pdl()
        got = step.output(None, label)
        monkeypatch.delenv("VLLM_LORA_DISABLE_PDL")
        supports_pdl.cache_clear()
        assert kernels._pdl()
        return got

    step = moe_tuner().Step(_shapes()[index], tmp_path, file_stem(torch.cuda.get_device_name()))
    for label in step.mappings:
        without_pdl(label)  # the inputs before: what a missing wait would read
        _new_inputs(step, 1)
        eager = step.output(None, label)
        want = without_pdl(label)
        assert all(torch.equal(a, b) for a, b in zip(eager, want)), label
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step.launch()
        for rep in range(8):
            _new_inputs(step, 2 + rep)
            want = without_pdl(label)
            step.y13.zero_()
            step.y2.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(step.y13.float(), want[0]) and torch.equal(step.y2.float(), want[1]), (label, rep)
