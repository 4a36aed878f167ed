"""MoE expert adapters: every on-disk layout -> one normalized form, validated by shape against the model.

On-disk layouts (after the ``base_model.model.`` prefix), for a block ``<prefix> = ...mlp.experts``
with ``E`` experts, hidden size ``H`` and expert intermediate size ``I``:

- **2D, per expert**: ``<prefix>.<e>.<proj>.lora_A.weight`` ``(r, in)`` and ``.lora_B.weight`` ``(out, r)``
  with ``<proj>`` the model's checkpoint names (``gate_proj/up_proj/down_proj``, Mixtral ``w1/w3/w2``).
- **3D, fused** (PEFT ``target_parameters``): ``<prefix>[.base_layer]*.lora_A.weight`` ``(r·E, in)``, rows
  expert-major (row ``e·r + i``), and ``.lora_B.weight`` ``(out, r·E)``, columns expert-minor (column
  ``i·E + e``). Per expert ``ΔW_e = B[:, i·E+e] · A[e·r+i, :]`` summed over ``i``.
  - gate_up: standard ``in = H, out = 2I`` (B rows: gate ``[0, I)`` then up ``[I, 2I)``; GPT-OSS interleaves:
    gate rows ``0::2``, up rows ``1::2``); *transposed* (PEFT 0.17–0.18 on transformers-v5 experts)
    ``in = 2I, out = H``, i.e. ``ΔW_e`` stored as its transpose.
  - down: standard ``in = I, out = H``; transposed ``in = H, out = I``.
  - Which tensor is gate_up and which is down is decided **by shape**, never by the nesting
    (``base_layer``) of its name; shapes that fit two readings (``H == 2I`` or ``H == I``) are settled
    by the adapter config (``peft_version``: < 0.19.1 wrote the transposed form; or an explicit
    ``"moe_3d_orientation": "standard" | "transposed"``), else refused.
- Both forms may be mixed in one adapter: per layer, and per projection inside a layer (a fused
  gate_up with per-expert down, or the reverse).

This module holds the model's facts about a block ([`MoESpec`]) and the normalized form. `moe_plan` assigns
each key of a block its role and orientation by shape; `moe_read` reads a planned block into the normalized form.

The normalized form ([`ExpertsLoRA`]) holds, for the experts this rank keeps, ``A (E', r, in)`` and
``B (E', out, r)`` per projection with the adapter's scaling folded into ``B`` (computed in float32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

__all__ = ["MoESpec", "ExpertFactors", "ExpertsLoRA", "Alloc", "Orientation", "Role", "turn_in_place"]

Alloc = Callable[[tuple[int, ...], "torch.dtype"], "torch.Tensor"]
"""``alloc(shape, dtype)``: memory a read writes a factor into (a build process's shared file, a host arena)."""

Orientation = Literal["standard", "transposed"]
Role = Literal["gate_up", "down"]

GATE_NAMES = ("gate_proj", "w1")
UP_NAMES = ("up_proj", "w3")
DOWN_NAMES = ("down_proj", "w2")


@dataclass(frozen=True)
class MoESpec:
    """What the running model says about one MoE block (shapes are full, not TP-sliced).

    Attributes:
        prefix: module path of the experts, e.g. ``model.layers.0.mlp.experts``.
        num_experts: global expert count ``E``.
        hidden: ``H``.
        intermediate: ``I`` (per expert).
        gate / up / down: the checkpoint projection names of 2D keys.
        interleaved: fused gate_up rows are interleaved (GPT-OSS) rather than concatenated.
    """

    prefix: str
    num_experts: int
    hidden: int
    intermediate: int
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    interleaved: bool = False

    def __post_init__(self) -> None:
        if min(self.num_experts, self.hidden, self.intermediate) < 1:
            raise ValueError(f"MoESpec {self.prefix!r} needs positive sizes")

    def proj_role(self, proj: str) -> str | None:
        """Map a 2D projection name to ``gate``/``up``/``down`` (model names first, then the common aliases)."""
        if proj == self.gate or (proj in GATE_NAMES and self.gate in GATE_NAMES):
            return "gate"
        if proj == self.up or (proj in UP_NAMES and self.up in UP_NAMES):
            return "up"
        if proj == self.down or (proj in DOWN_NAMES and self.down in DOWN_NAMES):
            return "down"
        return None


@dataclass
class ExpertFactors:
    """One projection for the kept experts: ``a (E', r, in)``, ``b (E', out, r)``, scaling folded into ``b``.

    ``lying``: ``(rows, cols, scale)`` where ``b``'s bytes are not yet ``b`` but a fused 3D B as stored, the
    row-major ``(rows, cols)`` matrix whose transpose times ``scale`` is ``b`` ([`turn_in_place`] makes it so;
    a build for a GPU leaves that to the GPU: ``BuildJob.defer_turn``).
    """

    a: torch.Tensor
    b: torch.Tensor
    lying: tuple[int, int, float] | None = None

    @property
    def rank(self) -> int:
        return int(self.a.shape[1])


@dataclass
class ExpertsLoRA:
    """A normalized MoE block: per-projection factors for ``experts`` (global ids, in local order).

    ``gate_up`` (fused, B rows gate then up, or interleaved if ``interleaved``) and ``gate``/``up``
    are alternatives; ``down`` is always separate.
    """

    prefix: str
    experts: tuple[int, ...]
    intermediate: int
    gate: ExpertFactors | None = None
    up: ExpertFactors | None = None
    down: ExpertFactors | None = None
    gate_up: ExpertFactors | None = None
    interleaved: bool = False

    def _split_gate_up(self, alloc: Alloc | None = None) -> tuple[ExpertFactors | None, ExpertFactors | None]:
        if self.gate_up is None:
            return self.gate, self.up
        b, lying = self.gate_up.b, self.gate_up.lying
        if lying is not None and self.interleaved:  # (a 3D-wrapper layout: kept fused, never split in serving)
            turn_in_place(b, *lying)
            self.gate_up = ExpertFactors(self.gate_up.a, b)
            lying = None
        if lying is not None:  # gate's rows lie first, then up's: each half of the bytes is its own lying B
            rows, cols, scale = lying
            flat, half = b.view(-1), b.numel() // 2
            gb, ub = flat[:half].view(b.shape[0], -1, b.shape[2]), flat[half:].view(b.shape[0], -1, b.shape[2])
            return (ExpertFactors(self.gate_up.a, gb, (rows // 2, cols, scale)),
                    ExpertFactors(self.gate_up.a, ub, (rows // 2, cols, scale)))
        if self.interleaved:
            gb, ub = b[:, 0::2], b[:, 1::2]
        else:
            gb, ub = b[:, : self.intermediate], b[:, self.intermediate:]
        return ExpertFactors(self.gate_up.a, _into(gb, alloc)), ExpertFactors(self.gate_up.a, _into(ub, alloc))

    def as_2d(self, *, num_experts: int, hidden: int,
              alloc: Alloc | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Return vLLM's 2D-wrapper lists ``[w1, w2, w3]`` (gate, down, up); absent projections are zeros.

        A fused gate_up B is split into new contiguous tensors (from ``alloc``, if given).
        """
        gate, up = self._split_gate_up(alloc)
        e, i, dt = len(self.experts), self.intermediate, self.dtype
        return ([_a(gate, e, hidden, dt), _a(self.down, e, i, dt), _a(up, e, hidden, dt)],
                [_b(gate, e, i, dt), _b(self.down, e, hidden, dt), _b(up, e, i, dt)])

    def as_3d(self, *, hidden: int, alloc: Alloc | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Return vLLM's 3D-wrapper lists ``[w13, w2]``; separate gate/up become one rank ``r_g + r_u`` factor
        (in new tensors from ``alloc``, if given)."""
        import torch

        e, i, dt = len(self.experts), self.intermediate, self.dtype
        new = alloc or (lambda shape, dtype: torch.empty(shape, dtype=dtype))
        if self.gate_up is not None:
            w13_a, w13_b = self.gate_up.a, self.gate_up.b
        elif (self.gate is not None and self.up is not None and self.gate.a.shape == self.up.a.shape
              and torch.equal(self.gate.a, self.up.a)):  # gate and up share A (e.g. a 3D adapter saved as 2D)
            w13_a = self.gate.a
            gb, ub = self.gate.b, self.up.b
            if self.interleaved:
                w13_b = torch.stack([gb, ub], dim=2, out=new((e, gb.shape[1], 2, gb.shape[2]), gb.dtype)).flatten(1, 2)
            else:
                w13_b = torch.cat([gb, ub], dim=1, out=new((e, gb.shape[1] + ub.shape[1], gb.shape[2]), gb.dtype))
        else:
            g, u = self.gate, self.up
            ref = g or u or self.down
            assert ref is not None
            rg, ru = (g.rank if g else 0), (u.rank if u else 0)
            w13_a = torch.cat([_a(g, e, hidden, dt, rg), _a(u, e, hidden, dt, ru)], dim=1,
                              out=new((e, rg + ru, hidden), dt))
            w13_b = new((e, 2 * i, rg + ru), ref.b.dtype).zero_()
            gate_rows = slice(0, 2 * i, 2) if self.interleaved else slice(0, i)
            up_rows = slice(1, 2 * i, 2) if self.interleaved else slice(i, 2 * i)
            if g is not None:
                w13_b[:, gate_rows, :rg] = g.b
            if u is not None:
                w13_b[:, up_rows, rg:] = u.b
        return [w13_a, _a(self.down, e, i, dt)], [w13_b, _b(self.down, e, hidden, dt)]

    @property
    def dtype(self) -> torch.dtype:
        return next(f.a.dtype for f in (self.gate, self.up, self.down, self.gate_up) if f is not None)

    @property
    def max_rank(self) -> int:
        return max(f.rank for f in (self.gate, self.up, self.down, self.gate_up) if f is not None)


def turn_in_place(t: torch.Tensor, rows: int, cols: int, scale: float | None) -> None:
    """Make a contiguous ``t`` whose bytes are the row-major ``(rows, cols)`` matrix ``m`` hold ``m.t() * scale``
    (``torch.mul`` in the same float32 opmath and one rounding as ``SafetensorsReader.read_transposed``, bit for
    bit; on whichever device ``t`` is)."""
    import torch

    lying = t.view(-1).view(rows, cols).clone()
    turned = t.view(-1).view(cols, rows)
    if scale is None:
        turned.copy_(lying.t())
    else:
        torch.mul(lying.t(), scale, out=turned)


def _a(f: ExpertFactors | None, e: int, d_in: int, dtype: torch.dtype, rank: int | None = None) -> torch.Tensor:
    import torch

    if f is not None:
        return f.a
    return torch.zeros(e, rank if rank is not None else 1, d_in, dtype=dtype)


def _b(f: ExpertFactors | None, e: int, d_out: int, dtype: torch.dtype) -> torch.Tensor:
    import torch

    if f is not None:
        return f.b
    return torch.zeros(e, d_out, 1, dtype=dtype)


def _into(t: torch.Tensor, alloc: Alloc | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` in ``dtype`` (default its own) as a contiguous tensor; with ``alloc``, always a copy in memory
    ``alloc`` gives, converted while copied (the same rounding as ``.to``)."""
    dtype = dtype or t.dtype
    if alloc is None:
        return t.to(dtype).contiguous()
    out = alloc(tuple(t.shape), dtype)
    out.copy_(t)
    return out
