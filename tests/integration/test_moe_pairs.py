"""The plugin's fused-MoE LoRA pair path (``integration/moe_pairs.py``): its two Triton kernels, run here by Triton's
own interpreter (``TRITON_INTERPRET=1``, in a fresh process: the flag is read at import), against a dense fp32
reference, and the rule that decides which calls of ``PunicaWrapperGPU.add_lora_fused_moe`` it takes
(``integration.kernels``). The GPU runs of the same kernels, through vLLM's wrapper and in CUDA graphs, are
``tests/gpu/test_moe_pairs.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

_KERNELS = r"""
import json, sys, torch
from vllm_lora_ext.integration.moe_pairs import Launch, PairRouting, moe_lora_pairs

def reference(out, x, a, b, w, eids, tmap, enabled, mul):
    tokens, top_k = w.shape
    n = b[0].shape[2]
    o = out.float().clone().view(tokens * top_k, -1)
    for p in range(tokens * top_k):
        t, e = p // top_k, int(eids[p])
        slot = int(tmap[t])
        if slot < 0 or slot >= a[0].shape[0] or e < 0 or not int(enabled[slot]):
            continue
        xin = x[p if mul else t].float()
        for s in range(len(a)):
            u = (a[s][slot, e].float() @ xin).to(x.dtype).float()
            d = b[s][slot, e].float() @ u
            if mul:
                d = d * w[t, p % top_k].float()
            o[p, s * n:(s + 1) * n] += d.to(out.dtype).float()
    return o.view_as(out).to(out.dtype).float()  # the output rounded once more, as the kernel stores it

torch.manual_seed(0)
report = []
# (tokens, top_k, experts, rank, K, N, slices, slots, mul, add): two slices unrouted (w13), one routed (w2), a rank
# below the 16-wide tile, K and N not multiples of the blocks, and an output written without adding
for tokens, top_k, experts, rank, k, n, slices, slots, mul, add in [
        (3, 2, 5, 4, 300, 24, 2, 3, False, True), (4, 3, 6, 16, 70, 130, 1, 2, True, True),
        (2, 2, 3, 32, 40, 20, 1, 2, True, False)]:
    dt = torch.bfloat16
    x = torch.randn(tokens * (top_k if mul else 1), k, dtype=dt)
    a = [torch.randn(slots, experts, rank, k, dtype=dt) * 0.1 for _ in range(slices)]
    b = [torch.randn(slots, experts, n, rank, dtype=dt) * 0.1 for _ in range(slices)]
    w = torch.rand(tokens, top_k)
    eids = torch.randint(0, experts, (tokens * top_k,), dtype=torch.int32)
    eids[1] = -1  # a pair with no expert
    tmap = torch.tensor([(i % (slots + 1)) - 1 for i in range(tokens)], dtype=torch.int32)  # token 0: no adapter
    if tokens > 2:
        tmap[-1] = slots  # a slot id past the last slot: no adapter either
    enabled = torch.ones(slots + 1, dtype=torch.int32)
    enabled[1] = 0  # a slot whose adapter has no experts
    out = torch.randn(tokens, top_k, slices * n, dtype=dt)
    want = reference(out, x, a, b, w, eids, tmap, enabled, mul) if add else \
        reference(torch.zeros_like(out), x, a, b, w, eids, tmap, enabled, mul)
    got = out.clone()
    moe_lora_pairs(got, x, (a, b), PairRouting(w, eids, tmap, enabled), mul_routed_weight=mul, add_inputs=add)
    skipped = [p for p in range(tokens * top_k) if not 0 <= int(tmap[p // top_k]) < slots or int(eids[p]) < 0
               or not int(enabled[int(tmap[p // top_k])])]
    for p in skipped:  # a pair with no LoRA is left as it was, written or added to alike (vLLM's kernel too)
        want.view(tokens * top_k, -1)[p] = out.view(tokens * top_k, -1)[p].float()
    flat_got, flat_out = got.view(tokens * top_k, -1), out.view(tokens * top_k, -1)
    report.append({"err": (got.float() - want).abs().max().item(), "scale": want.abs().max().item(),
                   "skipped_untouched": all(torch.equal(flat_got[p], flat_out[p]) for p in skipped),
                   "skipped": len(skipped), "moved": (got.float() - out.float()).abs().max().item()})
# vLLM's two roundings, each case built so that skipping it changes the output (fp16, whose conversions Triton's
# interpreter rounds to nearest even as the GPU does; one slot, one expert, rank 2): the shrink u = (1 + 2^-12, -1)
# rounds to (1, -1), so B = (1, 1) gives 0, not 2^-12; then a delta of 2^-11 + 2^-23 rounds to 2^-11 before it is
# added to 1.0, which rounds to 1.0 (a tie, to even), not to 1 + 2^-10.
exact = []
for x_row, a_rows, b_row, start in [([1.0, 2.0 ** -12], [[1.0, 1.0], [-1.0, 0.0]], [1.0, 1.0], 0.0),
                                     ([1.0, 0.0], [[1.0, 0.0], [1.0, 0.0]], [2.0 ** -11, 2.0 ** -23], 1.0)]:
    dt = torch.float16
    x = torch.tensor([x_row], dtype=dt)
    a = [torch.tensor(a_rows, dtype=dt).reshape(1, 1, 2, 2)]
    b = [torch.tensor(b_row, dtype=dt).reshape(1, 1, 1, 2).expand(1, 1, 4, 2).contiguous()]
    w, eids = torch.ones(1, 1), torch.zeros(1, dtype=torch.int32)
    tmap, enabled = torch.zeros(1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    out = torch.full((1, 1, 4), start, dtype=dt)
    got = out.clone()
    moe_lora_pairs(got, x, (a, b), PairRouting(w, eids, tmap, enabled), mul_routed_weight=False)
    exact.append([got.float().flatten().tolist(), reference(out, x, a, b, w, eids, tmap, enabled, False).flatten().tolist()])
# the live-rank table: slots of rank 32 holding adapters of rank 5 and 20 (zeros past them, as vLLM's set_lora
# leaves them) and one of rank 32 whose entry says "unknown" (2^30: clamped to 32) give with the table what they
# give without it, in one expand pass of 32 rows (the default) and in passes of 16; with NaN instead of zeros past
# the live ranks, the table's outputs are the same (the rows past it, and the partials the shrink did not write
# for them, are never read); a table saying 2 (the control) changes the output
dt = torch.bfloat16
x = torch.randn(6, 40, dtype=dt)
a = [torch.randn(3, 2, 32, 40, dtype=dt) * 0.3]
b = [torch.randn(3, 2, 24, 32, dtype=dt) * 0.3]
poisoned = ([a[0].clone()], [b[0].clone()])
for slot, rank in ((0, 5), (1, 20)):
    a[0][slot, :, rank:] = 0
    b[0][slot, ..., rank:] = 0
    poisoned[0][0][slot, :, rank:] = float("nan")
    poisoned[1][0][slot, ..., rank:] = float("nan")
routing = (torch.rand(6, 2), torch.randint(0, 2, (12,), dtype=torch.int32),
           torch.tensor([0, 1, 2, 1, 0, 2], dtype=torch.int32), torch.ones(4, dtype=torch.int32))
table = torch.tensor([5, 20, 1 << 30], dtype=torch.int32)
outs = {}
for name, factors, ranks, tiles in (("none", (a, b), None, None), ("live", (a, b), table, None),
                                    ("live16", (a, b), table, (256, 64, 1, 16)),
                                    ("poisoned", poisoned, table, None),
                                    ("poisoned16", poisoned, table, (256, 64, 1, 16)),
                                    ("short", (a, b), torch.tensor([2, 2, 2], dtype=torch.int32), None)):
    got = torch.zeros(6, 2, 24, dtype=dt)
    moe_lora_pairs(got, x, factors, PairRouting(*routing, ranks), mul_routed_weight=False, launch=Launch(tiles))
    outs[name] = got
live = {"equal": torch.equal(outs["live"], outs["none"]), "moved": outs["none"].float().abs().max().item(),
        "passes_of_16": (outs["live16"].float() - outs["none"].float()).abs().max().item(),
        "poisoned_equal": (torch.equal(outs["poisoned"], outs["none"])
                           and torch.equal(outs["poisoned16"], outs["live16"])),
        "short_off": (outs["short"].float() - outs["none"].float()).abs().max().item()}
print(json.dumps({"cases": report, "exact": exact, "live": live}))
"""


def test_the_pair_kernels_give_the_dense_reference_in_tritons_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", _KERNELS], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    report = result["cases"]
    assert len(report) == 3
    for case in report:
        # one bf16 step of the output's magnitude: the kernels sum in another order than the reference
        assert case["err"] <= case["scale"] * 2 ** -7, case
        assert case["moved"] > 10 * case["err"], case  # the control: the deltas are far above the error
    assert report[0]["skipped"] >= 3 and report[0]["skipped_untouched"] is True  # no adapter, no expert, disabled
    assert report[1]["skipped_untouched"] is True and report[2]["skipped_untouched"] is True
    # vLLM's roundings, exactly: the shrink (0, not 2^-12) and the delta before the add (1.0, not 1 + 2^-10)
    assert result["exact"] == [[[0.0] * 4, [0.0] * 4], [[1.0] * 4, [1.0] * 4]]
    # the slots' live ranks: the rows past them are not read, and nothing changes, bit for bit; a short table does
    live = result["live"]
    assert live["equal"] is True and live["moved"] > 0.5, live
    assert live["passes_of_16"] <= live["moved"] * 2 ** -7, live  # the same sums, added in two passes
    assert live["poisoned_equal"] is True, live  # nothing past a live rank is read, in either expand
    assert live["short_off"] > 0.1 * live["moved"], live


def _call(**over: object) -> dict[str, object]:
    x = torch.zeros(32, 64, dtype=torch.bfloat16)
    named: dict[str, object] = {
        "y": torch.zeros(32, 8, 2 * 48, dtype=torch.bfloat16), "x": x,
        "lora_a_stacked": (torch.zeros(16, 8, 16, 64, dtype=torch.bfloat16),) * 2,
        "lora_b_stacked": (torch.zeros(16, 8, 48, 16, dtype=torch.bfloat16),) * 2,
        "topk_weights": torch.zeros(32, 8), "sorted_token_ids": None, "fully_sharded": False, "offset": 0}
    named.update(over)
    return named


def test_the_pair_path_fits_only_what_vllm_assigns_pair_by_pair_beyond_its_small_batch_kernel() -> None:
    from vllm_lora_ext.integration import kernels

    assert kernels._pairs_fit(_call())  # 256 pairs x r16
    assert not kernels._pairs_fit(_call(sorted_token_ids=torch.zeros(1)))  # vLLM's sorted blocks
    assert not kernels._pairs_fit(_call(fully_sharded=True))
    assert not kernels._pairs_fit(_call(offset=64))
    assert not kernels._pairs_fit(_call(topk_weights=torch.zeros(8, 8)))  # 64 pairs x r16: vLLM's small batch
    assert kernels._pairs_fit(_call(lora_a_stacked=(torch.zeros(16, 8, 32, 64, dtype=torch.bfloat16),) * 2))
    big = (torch.zeros(16, 8, 64, 64, dtype=torch.bfloat16),) * 2
    assert not kernels._pairs_fit(_call(lora_a_stacked=big))  # rank 64 > PAIRS_MAX_RANK
    assert not kernels._pairs_fit(_call(x=torch.zeros(32, 64)))  # fp32
    assert not kernels._pairs_fit(_call(x=torch.zeros(64, 32, dtype=torch.bfloat16).t()))  # not contiguous along K
    strided_a = (torch.zeros(16, 8, 64, 16, dtype=torch.bfloat16).transpose(2, 3),) * 2  # A not contiguous along K
    assert not kernels._pairs_fit(_call(lora_a_stacked=strided_a))
    assert not kernels._pairs_fit(_call(y=torch.zeros(32, 8, 2 * 48 + 8, dtype=torch.bfloat16)))  # wider than N
    fp32_b = (torch.zeros(16, 8, 48, 16),) * 2
    assert not kernels._pairs_fit(_call(lora_b_stacked=fp32_b))


def test_the_pair_path_never_takes_a_cpu_batch() -> None:
    from vllm_lora_ext.integration import kernels

    assert kernels._pairs_fit(_call()) and not kernels._pairs_take(_call())
