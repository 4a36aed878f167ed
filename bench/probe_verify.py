"""Probe: ``vllm-lora verify --layers 2 --load-format dummy`` on the Qwen3-30B-A3B-shaped bench model (one GPU).

The model is the bench's bare ``config.json`` (bench_moe_load.QWEN3_30B_A3B: 48 layers, 128 experts, no weights,
no tokenizer). The adapter is PEFT-shaped, rank 16: q/k/v/o on every layer and 3D experts (``target_parameters``),
random factors of std ``--scale``. Two runs:

1. the adapter as trained: expected ``verdict: PASS``;
2. ``--served`` an adapter without its expert keys (what a loader that accepts 3D expert keys and ignores them
   serves): expected ``verdict: FAIL vLLM does not apply routed_experts``.

Each run's JSON (``--json``) and wall time go to ``bench/results/verify_qwen3_30b_a3b.json``.

Usage: python bench/probe_verify.py [--layers 2] [--scale 0.05] [--gpu-memory-utilization 0.8] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402
from bench_moe_load import QWEN3_30B_A3B  # noqa: E402

E, H, I, R, ALPHA = 128, 2048, 768, 16, 32
ATTN = {"q_proj": (H, 32 * 128), "k_proj": (H, 4 * 128), "v_proj": (H, 4 * 128), "o_proj": (32 * 128, H)}


def make_adapter(folder: Path, layers: int, scale: float, *, experts: bool = True) -> Path:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).bfloat16()

    t: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        p = f"base_model.model.model.layers.{layer}"
        for name, (d_in, d_out) in ATTN.items():
            t[f"{p}.self_attn.{name}.lora_A.weight"] = rand(R, d_in)
            t[f"{p}.self_attn.{name}.lora_B.weight"] = rand(d_out, R)
        gate_up_a, gate_up_b, down_a, down_b = rand(E * R, H), rand(2 * I, R * E), rand(E * R, I), rand(H, R * E)
        if experts:
            t[f"{p}.mlp.experts.base_layer.lora_A.weight"], t[f"{p}.mlp.experts.base_layer.lora_B.weight"] = \
                gate_up_a, gate_up_b
            t[f"{p}.mlp.experts.lora_A.weight"], t[f"{p}.mlp.experts.lora_B.weight"] = down_a, down_b
    folder.mkdir(parents=True, exist_ok=True)
    save_file(t, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": R, "lora_alpha": ALPHA, "target_modules": list(ATTN), "bias": "none",
           "peft_version": "0.21.0"}
    if experts:
        cfg["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return folder


def verify(model: Path, adapter: Path, layers: int, out: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "vllm_lora_ext.cli", "verify", str(model), str(adapter), "--layers", str(layers),
           "--load-format", "dummy", "--json", str(out), *extra]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    print(done.stdout, done.stderr[-3000:] if done.returncode not in (0, 1) else "", sep="\n", flush=True)
    result = json.loads(out.read_text()) if out.exists() else {"error": done.stderr[-3000:]}
    return {"exit": done.returncode, "wall_s": round(wall, 1), "verdict": done.stdout.strip().splitlines()[-1:],
            "result": result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--scale", type=float, default=0.05)
    ap.add_argument("--out", default=None)
    ap.add_argument("--gpu-memory-utilization", default="0.8", help="passed to verify (lower it beside other engines)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "model").mkdir()
        (work / "model" / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
        adapter = make_adapter(work / "adapter", QWEN3_30B_A3B["num_hidden_layers"], args.scale)
        served = make_adapter(work / "served", QWEN3_30B_A3B["num_hidden_layers"], args.scale, experts=False)
        mem = ("--gpu-memory-utilization", args.gpu_memory_utilization)
        runs = {"as_trained": verify(work / "model", adapter, args.layers, work / "a.json", *mem),
                "served_without_experts": verify(work / "model", adapter, args.layers, work / "b.json",
                                                 "--served", str(served), *mem)}
    write_json("verify_qwen3_30b_a3b", {"model": "Qwen3-30B-A3B config, random weights (verify --load-format dummy)",
                                        "layers": args.layers, "scale": args.scale, "runs": runs}, args.out)


if __name__ == "__main__":
    main()
