"""Expert parallelism on 2 GPUs: the plugin's rank-local reads give the same model as one GPU.

A tiny Qwen3-MoE with a 2D (per-expert) and a 3D (PEFT target_parameters) expert adapter carrying the
same delta: TP=2 with ``enable_expert_parallel`` (each rank reads only its 4 of 8 experts) must match
the single-GPU run (teacher-forced logprobs within tolerance, same first tokens), and the 2D and 3D
forms must give identical outputs under EP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tiny import build_peft_adapter, build_qwen3_moe, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]


def _gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return len([ln for ln in out.stdout.splitlines() if ln.startswith("GPU ")])
    except OSError:
        return 0


def _run(model: Path, tp: int, adapters: dict[str, str], ps: list[list[int]], log: Path) -> dict[str, Any]:
    env = dict(os.environ, VLLM_WORKER_MULTIPROC_METHOD="spawn")
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("ep_run.py")), str(model), str(tp),
                          json.dumps(adapters), json.dumps(ps)], capture_output=True, text=True, env=env, timeout=900)
    log.write_text(out.stdout[-100000:] + "\n---\n" + out.stderr[-100000:])
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("EPRESULT ")]
    assert line, out.stderr[-5000:]
    return json.loads(line[-1][len("EPRESULT "):])


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")
def test_expert_parallel_two_gpus_matches_one_gpu(gpu_workdir: Path, record: Any) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from test_moe_e2e import _truths_from_peft, _write_forms

    model = build_qwen3_moe(gpu_workdir / "ep-moe")
    peft_dir = build_peft_adapter(model, gpu_workdir / "ep-3d", seed=9, rank=8, alpha=16, targets=["q_proj"],
                                  target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    truths, rest = _truths_from_peft(peft_dir, 2, 8, "mlp")
    forms = _write_forms(peft_dir, gpu_workdir / "ep-forms", truths, rest, "mlp", ("gate_proj", "up_proj", "down_proj"))
    adapters = {"ep2d": str(forms["2d"]), "ep3d": str(forms["3d"])}
    ps = prompts()
    one = _run(model, 1, adapters, ps, gpu_workdir / "ep-tp1.log")
    two = _run(model, 2, adapters, ps, gpu_workdir / "ep-tp2.log")
    gaps = []
    for name in adapters:
        for a, b in zip(one[name]["prompt_logprobs"], two[name]["prompt_logprobs"]):
            gaps += [abs(x - y) for x, y in zip(a[1:], b[1:])]
    first_equal = all(x[0] == y[0] for n in adapters for x, y in zip(one[n]["tokens"], two[n]["tokens"]))
    layouts_identical = two["ep2d"] == two["ep3d"]
    record("expert_parallel_2gpu", {"mean_prompt_logprob_gap_tp1_vs_ep2": sum(gaps) / len(gaps), "max": max(gaps),
                                    "first_tokens_equal": first_equal, "ep_2d_equals_3d": layouts_identical,
                                    "tokens_equal": all(one[n]["tokens"] == two[n]["tokens"] for n in adapters)})
    out = os.environ.get("OUT")
    if out:
        for f in ("ep-tp1.log", "ep-tp2.log"):
            (Path(out) / f).write_text((gpu_workdir / f).read_text()[-3_000_000:])
    assert layouts_identical
    assert first_equal and sum(gaps) / len(gaps) < 0.1
