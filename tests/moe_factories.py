"""MoE adapters in every on-disk layout, all written from one ground truth (so their deltas must match).

Ground truth per layer: A13 (E, r, H), B13 (E, 2I, r) for gate_up (gate rows then up rows; the 3D
format shares one A for gate and up), Ad (E, r, I), Bd (E, H, r) for down.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from factories import lora_config, write_adapter

PREFIX = "base_model.model."


class KeyByKey:
    """A tensor source seen through ``read`` and ``read_many`` only (``read_many`` by default: ``read`` per key), so
    that a MoE block read takes its key-by-key path, as for an adapter already in memory."""

    def __init__(self, read: Callable[..., torch.Tensor],
                 read_many: Callable[..., Mapping[str, torch.Tensor]] | None = None) -> None:
        self.read = read
        self._many = read_many

    def read_many(self, keys: Sequence[str], *, copy: bool = True) -> Mapping[str, torch.Tensor]:
        if self._many is None:
            return {k: self.read(k, None) for k in keys}
        return self._many(keys, copy=copy)
Form = Literal["2d", "3d", "3d_t", "3d_gu+2d_down", "2d_gu+3d_down"]


@dataclass
class Truth:
    a13: torch.Tensor
    b13: torch.Tensor
    ad: torch.Tensor
    bd: torch.Tensor


def make_truth(num_experts: int, hidden: int, inter: int, rank: int, seed: int, dtype: torch.dtype = torch.float32) -> Truth:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.1).to(dtype)  # noqa: E731
    return Truth(r(num_experts, rank, hidden), r(num_experts, 2 * inter, rank), r(num_experts, rank, inter),
                 r(num_experts, hidden, rank))


def to_3d(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, r, in), (E, out, r) -> PEFT target_parameters tensors A (r·E, in) expert-major, B (out, r·E) expert-minor."""
    e, r, d_in = a.shape
    return a.reshape(e * r, d_in).contiguous(), b.permute(1, 2, 0).reshape(b.shape[1], r * e).contiguous()


def to_3d_transposed(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The PEFT 0.17-0.18 form: the transposed delta, i.e. A' = Bᵀ, B' = Aᵀ per expert, then fused."""
    return to_3d(b.transpose(1, 2), a.transpose(1, 2))


def block_tensors(layer_prefix: str, t: Truth, form: Form, *, names: Sequence[str] = ("gate_proj", "up_proj", "down_proj"),
                  interleaved: bool = False) -> dict[str, torch.Tensor]:
    """One MoE block's keys in ``form``; ``interleaved``: the fused B rows alternate gate/up (GPT-OSS)."""
    gate, up, down = names
    experts = f"{PREFIX}{layer_prefix}.experts"
    inter = t.b13.shape[1] // 2
    out: dict[str, torch.Tensor] = {}

    def two_d(roles: Sequence[str]) -> None:
        for e in range(t.a13.shape[0]):
            gate_rows = slice(0, 2 * inter, 2) if interleaved else slice(0, inter)
            up_rows = slice(1, 2 * inter, 2) if interleaved else slice(inter, 2 * inter)
            if "gate" in roles:
                out[f"{experts}.{e}.{gate}.lora_A.weight"] = t.a13[e].clone()
                out[f"{experts}.{e}.{gate}.lora_B.weight"] = t.b13[e, gate_rows].clone()
            if "up" in roles:
                out[f"{experts}.{e}.{up}.lora_A.weight"] = t.a13[e].clone()
                out[f"{experts}.{e}.{up}.lora_B.weight"] = t.b13[e, up_rows].clone()
            if "down" in roles:
                out[f"{experts}.{e}.{down}.lora_A.weight"] = t.ad[e].clone()
                out[f"{experts}.{e}.{down}.lora_B.weight"] = t.bd[e].clone()

    def three_d(role: str, key: str, transposed: bool) -> None:
        a, b = (t.a13, t.b13) if role == "gate_up" else (t.ad, t.bd)
        fa, fb = (to_3d_transposed if transposed else to_3d)(a, b)
        out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = fa, fb

    if form == "2d":
        two_d(["gate", "up", "down"])
    elif form in ("3d", "3d_t"):
        three_d("gate_up", f"{experts}.base_layer", form == "3d_t")
        three_d("down", experts, form == "3d_t")
    elif form == "3d_gu+2d_down":
        three_d("gate_up", experts, False)
        two_d(["down"])
    elif form == "2d_gu+3d_down":
        two_d(["gate", "up"])
        three_d("down", experts, False)
    return out


def write_moe_adapter(folder: Path, truths: Sequence[Truth], forms: Sequence[Form], *, rank: int, alpha: float = 16,
                      names: Sequence[str] = ("gate_proj", "up_proj", "down_proj"), block: str = "mlp",
                      extra: dict[str, torch.Tensor] | None = None, **cfg: object) -> Path:
    tensors: dict[str, torch.Tensor] = {}
    for layer, (t, form) in enumerate(zip(truths, forms)):
        tensors.update(block_tensors(f"model.layers.{layer}.{block}", t, form, names=names))
    tensors.update(extra or {})
    write_adapter(folder, tensors, lora_config(rank, alpha, ["gate_proj", "up_proj", "down_proj"], **cfg))
    return folder


def oracle_deltas(t: Truth, scaling: float) -> dict[str, torch.Tensor]:
    """Dense per-expert ΔW (E, out, in) computed straight from the truth, independent of the code under test."""
    inter = t.b13.shape[1] // 2
    return {"gate": torch.einsum("eor,eri->eoi", t.b13[:, :inter].float(), t.a13.float()) * scaling,
            "up": torch.einsum("eor,eri->eoi", t.b13[:, inter:].float(), t.a13.float()) * scaling,
            "down": torch.einsum("eor,eri->eoi", t.bd.float(), t.ad.float()) * scaling}


def dense_delta(experts: Any, local_index: int) -> dict[str, torch.Tensor]:
    """Return ``{"gate","up","down": ΔW (out, in)}`` for one kept expert of an ``ExpertsLoRA``, in float32."""
    gate, up = experts._split_gate_up()
    out = {}
    for name, f in (("gate", gate), ("up", up), ("down", experts.down)):
        if f is not None:
            out[name] = f.b[local_index].float() @ f.a[local_index].float()
    return out


def peft_3d_delta(a_file: torch.Tensor, b_file: torch.Tensor, num_experts: int, scaling: float) -> torch.Tensor:
    """PEFT's own formula for a target_parameters delta: einsum('o r e, e r i -> e o i')."""
    rank = a_file.shape[0] // num_experts
    return torch.einsum("ore,eri->eoi", b_file.float().reshape(b_file.shape[0], rank, num_experts),
                        a_file.float().reshape(num_experts, rank, a_file.shape[1])) * scaling


# A two-block MoE model for build tests (E experts, hidden H, intermediate I, adapters of rank R).
BUILD_E, BUILD_H, BUILD_I, BUILD_R = 4, 24, 8, 4
BUILD_BLOCKS = tuple(f"model.layers.{i}.mlp.experts" for i in range(2))


def moe_build_job(path: Path, *, wrapper: str = "2d", experts: tuple[int, ...] | None = None, max_rank: int = 16) -> Any:
    """A `BuildJob` for the two-block model above, built in bfloat16."""
    from vllm_lora_ext.building import BuildJob
    from vllm_lora_ext.formats.moe import MoESpec
    from vllm_lora_ext.planning import ModelSpec

    e, h, i = BUILD_E, BUILD_H, BUILD_I
    return BuildJob(path=str(path), name="moe",
                    model=ModelSpec(frozenset(BUILD_BLOCKS), moe={p: MoESpec(p, e, h, i) for p in BUILD_BLOCKS},
                                    local_experts={p: experts or tuple(range(e)) for p in BUILD_BLOCKS},
                                    max_rank=max_rank),
                    wrappers={p: wrapper for p in BUILD_BLOCKS}, dtype=torch.bfloat16)


def spy_gpu_transposes(monkeypatch: Any) -> list[bool]:
    """Record, in the list returned, whether each B offered to a GPU by ``read_transposed(device=...)`` was turned
    there (``True``) or left to the CPU (``False``); the reads themselves run as they would."""
    from vllm_lora_ext.reader import SafetensorsReader

    tried: list[bool] = []
    real = SafetensorsReader._transposed_on

    def spy(self: SafetensorsReader, *args: Any, **kwargs: Any) -> bool:
        tried.append(real(self, *args, **kwargs))
        return tried[-1]

    monkeypatch.setattr(SafetensorsReader, "_transposed_on", spy)
    return tried


def merge_manager(layers: int, experts: int, **fields: Any) -> Any:
    """vLLM's ``LRUCacheLoRAModelManager`` made with ``object.__new__`` (its constructor needs a model on a GPU), with
    the fields its merge of packed modules reads: per layer an experts block of per-expert gate/down/up parts and
    q/k/v; ``fields`` set more (``is_pooling_model``, ``supports_mm``, ...)."""
    from vllm.lora.model_manager import LRUCacheLoRAModelManager

    mgr = object.__new__(LRUCacheLoRAModelManager)
    mgr.is_pooling_model = False
    mgr.modules = {}
    mgr.packed_modules = {}
    for layer in range(layers):
        mgr.packed_modules[f"model.layers.{layer}.mlp.experts"] = [
            f"model.layers.{layer}.mlp.experts.{e}.{w}" for e in range(experts)
            for w in ("gate_proj", "down_proj", "up_proj")]
        mgr.packed_modules[f"model.layers.{layer}.self_attn.qkv_proj"] = [
            f"model.layers.{layer}.self_attn.{w}_proj" for w in "qkv"]
    for name in ("_enable_moe_shared_loras", "_is_non_gated_moe", "_enable_mixed_moe_lora_format",
                 "_is_3d_moe_model"):
        setattr(mgr, name, False)
    for name, value in fields.items():
        setattr(mgr, name, value)
    return mgr


def merge_adapter(layers: int, experts: int, *, per_expert_layers: Sequence[int] = (), qkv: str = "qkv",
                  lora_id: int = 1) -> Any:
    """A ``LoRAModel`` for [`merge_manager`]: prepacked MoE blocks (as the plugin builds them), the given q/k/v parts
    and o_proj in every layer, random factors; layers in ``per_expert_layers`` carry per-expert parts instead of a
    prepacked block (vLLM's merge packs them)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import LoRALayerWeights, PackedLoRALayerWeights

    g = torch.Generator().manual_seed(0)

    def dense(name: str, rows: int, scaling: float = 1.0) -> Any:
        return LoRALayerWeights(name, 2, 4, torch.randn(2, rows, generator=g), torch.randn(rows, 2, generator=g),
                                scaling=scaling)

    loras: dict[str, Any] = {}
    for layer in range(layers):
        name = f"model.layers.{layer}.mlp.experts"
        if layer in per_expert_layers:
            loras.update({f"{name}.{e}.{w}": dense(f"{name}.{e}.{w}", 8) for e in range(experts)
                          for w in ("gate_proj", "down_proj", "up_proj")})
        else:
            loras[name] = PackedLoRALayerWeights(name, 2, [1] * 3, [torch.randn(1, 2, 8, generator=g) for _ in "abc"],
                                                 [torch.randn(1, 8, 2, generator=g) for _ in "abc"],
                                                 scaling=[1.0] * 3)
        for w in qkv + "o":
            sub = f"model.layers.{layer}.self_attn.{w}_proj"
            loras[sub] = dense(sub, 16, 2.0)
    return LoRAModel(lora_id, 2, loras)


def deferred_model(tmp_path: Path, wrapper: str = "2d") -> tuple[Any, Any]:
    """A LoRAModel of a fused 3D adapter built as a build process does for a GPU (handed over, B as stored, marked
    ``UNTURNED_ATTR`` as the loader marks it), and the ordinary build's ``moe``."""
    from vllm.lora.lora_model import LoRAModel

    from dataclasses import replace

    from vllm_lora_ext.building import build_adapter
    from vllm_lora_ext.integration.moe import packed_layer
    from vllm_lora_ext.integration.patching import UNTURNED_ATTR
    from vllm_lora_ext.planning import PeftKeyRouter
    from vllm_lora_ext.transport.handover import from_shared, to_shared

    truths = [make_truth(BUILD_E, BUILD_H, BUILD_I, BUILD_R, s, dtype=torch.bfloat16) for s in (0, 1)]
    folder = write_moe_adapter(tmp_path / "a", truths, ["3d", "3d"], rank=BUILD_R, alpha=24)
    job = replace(moe_build_job(folder, wrapper=wrapper), scan_moe=False)
    want = build_adapter(job, PeftKeyRouter())
    built, _ = from_shared(to_shared(build_adapter(replace(job, defer_turn=True), PeftKeyRouter(), shared=True)))
    assert built.unturned
    loras = {p: packed_layer(p, a, b, r) for p, (a, b, r) in built.moe.items()}
    model = LoRAModel(1, BUILD_R, loras)
    setattr(model, UNTURNED_ATTR, [(built.moe[p][1][i], rows, cols, scale)
                                   for p, parts in built.unturned.items() for i, rows, cols, scale in parts])
    return model, want.moe


def assert_served_as_built(model: Any, want: Any) -> None:
    for prefix, (a, b, _) in want.items():
        got = model.loras[prefix]
        for x, y in zip(list(got.lora_a) + list(got.lora_b), a + b):
            assert torch.equal(x.cpu(), y)
