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

The normalized form ([`ExpertsLoRA`]) holds, for the experts this rank keeps, ``A (E', r, in)`` and
``B (E', out, r)`` per projection with the adapter's scaling folded into ``B`` (computed in float32).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Literal, NamedTuple

import torch

from vllm_lora_ext.config import AdapterConfig
from vllm_lora_ext.errors import ExpertLayoutError
from vllm_lora_ext.formats import classify_key, strip_peft_prefix
from vllm_lora_ext.validation import check_finite

__all__ = ["MoESpec", "ExpertFactors", "ExpertsLoRA", "ExpertsPlan", "plan_experts", "read_experts",
           "read_blocks", "ExpertRead"]

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
    """One projection for the kept experts: ``a (E', r, in)``, ``b (E', out, r)``, scaling folded into ``b``."""

    a: torch.Tensor
    b: torch.Tensor

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
        b = self.gate_up.b
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

    def dense_delta(self, local_index: int) -> dict[str, torch.Tensor]:
        """Return ``{"gate","up","down": ΔW (out, in)}`` for one kept expert, in float32 (for tests and mixing)."""
        gate, up = self._split_gate_up()
        out = {}
        for name, f in (("gate", gate), ("up", up), ("down", self.down)):
            if f is not None:
                out[name] = f.b[local_index].float() @ f.a[local_index].float()
        return out

    @property
    def dtype(self) -> torch.dtype:
        return next(f.a.dtype for f in (self.gate, self.up, self.down, self.gate_up) if f is not None)

    @property
    def max_rank(self) -> int:
        return max(f.rank for f in (self.gate, self.up, self.down, self.gate_up) if f is not None)


def _a(f: ExpertFactors | None, e: int, d_in: int, dtype: torch.dtype, rank: int | None = None) -> torch.Tensor:
    if f is not None:
        return f.a
    return torch.zeros(e, rank if rank is not None else 1, d_in, dtype=dtype)


def _b(f: ExpertFactors | None, e: int, d_out: int, dtype: torch.dtype) -> torch.Tensor:
    if f is not None:
        return f.b
    return torch.zeros(e, d_out, 1, dtype=dtype)


# ------------------------------------------------------------------------------------------------
# planning (shapes only)


class Key2D(NamedTuple):
    """One expert's factor pair for one projection (a tuple: a 2D block has thousands)."""

    key_a: str
    key_b: str
    expert: int
    role: str  # gate / up / down
    rank: int


@dataclass(frozen=True)
class Key3D:
    key_a: str
    key_b: str
    role: Role
    orientation: Orientation
    rank: int


@dataclass
class ExpertsPlan:
    """How to read one MoE block: which keys play which role, oriented how, at which rank."""

    spec: MoESpec
    keys_2d: list[Key2D] = field(default_factory=list)
    keys_3d: list[Key3D] = field(default_factory=list)

    @property
    def layout(self) -> str:
        kinds = {"2d"} if self.keys_2d else set()
        if self.keys_3d:
            kinds.add("3d")
        return "+".join(sorted(kinds))


def _orientation_hint(config: AdapterConfig | None) -> Orientation | None:
    if config is None:
        return None
    explicit = config.raw.get("moe_3d_orientation")
    if explicit in ("standard", "transposed"):
        return explicit  # type: ignore[return-value]
    if config.peft_version:
        try:
            from packaging.version import Version

            return "transposed" if Version(config.peft_version.split("+")[0]) < Version("0.19.1") else "standard"
        except Exception:
            return None
    return None


def _readings_3d(shape_a: tuple[int, ...], shape_b: tuple[int, ...], spec: MoESpec) -> list[tuple[Role, Orientation]]:
    h, i = spec.hidden, spec.intermediate
    d_in, d_out = shape_a[1], shape_b[0]
    table: list[tuple[Role, Orientation, int, int]] = [
        ("gate_up", "standard", h, 2 * i), ("gate_up", "transposed", 2 * i, h),
        ("down", "standard", i, h), ("down", "transposed", h, i),
    ]
    return [(role, o) for role, o, a_in, b_out in table if (d_in, d_out) == (a_in, b_out)]


def _plan_complete_2d(shapes: Mapping[str, tuple[int, ...]], spec: MoESpec) -> ExpertsPlan | None:
    """The plan of a block that is every expert of every projection, per expert (2D), at one rank per
    projection and with the model's shapes, found with map and set passes rather than checks per key;
    ``None`` for anything else (which [`plan_experts`] then checks key by key, to name what is wrong).

    The keys must be exactly the ones the block's prefix, the projection names the model takes and the
    experts ``0..E-1`` spell, so that every key is accounted for and none is doubled (``01`` and ``1``, or one
    expert with and without PEFT's prefix, make a key set that is not that one).
    """
    first = next(iter(shapes), None)
    if first is None:
        return None
    info = classify_key(first)
    if info.kind != "moe_2d" or info.experts_prefix is None:
        return None
    head = f"{first[:len(first) - len(strip_peft_prefix(first))]}{info.experts_prefix}."  # with PEFT's prefix, if any
    names = {spec.gate, spec.up, spec.down}
    names.update(*(group for group, own in ((GATE_NAMES, spec.gate), (UP_NAMES, spec.up), (DOWN_NAMES, spec.down))
                   if own in group))
    projs = [p for p in sorted(names) if f"{head}0.{p}.lora_A.weight" in shapes]
    roles = [role for p in projs if (role := spec.proj_role(p)) is not None]
    if len(set(roles)) != len(projs) or len(shapes) != 2 * spec.num_experts * len(projs):
        return None
    experts = range(spec.num_experts)
    plan = ExpertsPlan(spec)
    spelled = 0
    for proj, role in zip(projs, roles):
        keys_a = [f"{head}{e}.{proj}.lora_A.weight" for e in experts]
        keys_b = [f"{head}{e}.{proj}.lora_B.weight" for e in experts]
        try:
            shapes_a = set(map(tuple, map(shapes.__getitem__, keys_a)))  # (a caller's shapes may be lists)
            shapes_b = set(map(tuple, map(shapes.__getitem__, keys_b)))
        except (KeyError, TypeError):
            return None
        if len(shapes_a) != 1 or len(shapes_b) != 1:
            return None
        sa, sb = shapes_a.pop(), shapes_b.pop()
        d_in = spec.intermediate if role == "down" else spec.hidden
        d_out = spec.hidden if role == "down" else spec.intermediate
        if len(sa) != 2 or sa != (sa[0], d_in) or sb != (d_out, sa[0]):
            return None
        plan.keys_2d += map(Key2D, keys_a, keys_b, experts, repeat(role), repeat(sa[0]))
        spelled += 2 * len(keys_a)
    # Every key spelled is in the block, all are distinct (one per projection, expert and factor) and as many
    # as the block has: they are the block.
    return plan if spelled == len(shapes) else None


def plan_experts(shapes: Mapping[str, tuple[int, ...]], spec: MoESpec, *, config: AdapterConfig | None = None,
                 adapter: str = "adapter") -> ExpertsPlan:
    """Assign every key of one MoE block a role and orientation, checking all shapes against ``spec``.

    Args:
        shapes: ``{key: shape}`` of the block's keys only (both 2D and 3D).
        spec: the block as the model has it.
        config: the adapter's config (orientation hints).

    Raises:
        [`ExpertLayoutError`]: a key fits no role, ranks do not divide, expert ids are out of range,
            a projection is given twice, or the orientation is ambiguous and nothing settles it.
    """
    complete = _plan_complete_2d(shapes, spec)
    if complete is not None:
        return complete
    pairs: dict[str, dict[str, str]] = {}
    infos: dict[str, Any] = {}
    for key in shapes:
        info = infos[key] = classify_key(key)
        pairs.setdefault(info.module, {})[info.which] = key
    plan = ExpertsPlan(spec)
    problems: list[str] = []
    seen_roles: dict[str, str] = {}
    hint = _orientation_hint(config)
    threed: list[tuple[str, str, str]] = []
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            problems.append(f"{module}: lora_{'A' if 'A' in pair else 'B'} without its partner")
            continue
        sa, sb = tuple(shapes[pair["A"]]), tuple(shapes[pair["B"]])
        info = infos[pair["A"]]
        if len(sa) != 2 or len(sb) != 2:
            problems.append(f"{module}: lora tensors must be 2-D, got {sa} and {sb}")
            continue
        if info.kind == "moe_2d":
            assert info.expert is not None and info.proj is not None
            role = spec.proj_role(info.proj)
            if role is None:
                problems.append(f"{module}: projection {info.proj!r} is not one of the model's "
                                f"({spec.gate}, {spec.up}, {spec.down})")
                continue
            if not 0 <= info.expert < spec.num_experts:
                problems.append(f"{module}: expert {info.expert} out of range (the model has {spec.num_experts})")
                continue
            d_in = spec.intermediate if role == "down" else spec.hidden
            d_out = spec.hidden if role == "down" else spec.intermediate
            r = sa[0]
            if sa != (r, d_in) or sb != (d_out, r):
                problems.append(f"{module}: shapes A{sa} B{sb}, expected A(r, {d_in}) B({d_out}, r) for {role}")
                continue
            plan.keys_2d.append(Key2D(pair["A"], pair["B"], info.expert, role, r))
            seen_roles.setdefault(role, "2d")
        else:
            threed.append((module, pair["A"], pair["B"]))
    # 3D: decide roles by shape; with two tensors, each must take a different role.
    readings = {m: _readings_3d(tuple(shapes[a]), tuple(shapes[b]), spec) for m, a, b in threed}
    for module, ka, kb in threed:
        sa, sb = tuple(shapes[ka]), tuple(shapes[kb])
        options = readings[module]
        if not options:
            problems.append(f"{module}: 3D shapes A{sa} B{sb} fit neither gate_up (A(r·E, {spec.hidden}) "
                            f"B({2 * spec.intermediate}, r·E)) nor down (A(r·E, {spec.intermediate}) "
                            f"B({spec.hidden}, r·E)), standard or transposed")
            continue
        others = {r for m, *_ in threed if m != module for r, _ in readings[m]}
        roles = {r for r, _ in options}
        if len(roles) > 1 and len(others) == 1:
            roles -= others  # the other tensor's role settles this one
        if len(roles) > 1:
            problems.append(f"{module}: 3D shapes A{sa} B{sb} fit both gate_up and down; the model's H={spec.hidden}, "
                            f"I={spec.intermediate} cannot tell them apart")
            continue
        (role,) = roles
        orients = {o for r, o in options if r == role}
        if len(orients) > 1:
            if hint is None:
                problems.append(
                    f"{module}: 3D {role} shapes A{sa} B{sb} read the same in standard and transposed orientation "
                    f"(H={spec.hidden}, I={spec.intermediate}); add \"moe_3d_orientation\": \"standard\" or "
                    f"\"transposed\" (or the PEFT \"peft_version\" that wrote it) to the adapter config")
                continue
            orients = {hint}
        (orient,) = orients
        rows = sa[0]
        if rows % spec.num_experts or sb[1] != rows:
            problems.append(f"{module}: 3D A has {rows} rows and B {sb[1]} columns; both must be r·E with "
                            f"E={spec.num_experts}")
            continue
        if role in seen_roles or (role == "gate_up" and ({"gate", "up"} & set(seen_roles))):
            problems.append(f"{module}: {role} is given twice (as 3D and as {seen_roles.get(role, '2d')})")
            continue
        seen_roles[role] = "3d"
        plan.keys_3d.append(Key3D(ka, kb, role, orient, rows // spec.num_experts))
    if any(k.role in ("gate", "up") for k in plan.keys_2d) and any(k.role == "gate_up" for k in plan.keys_3d):
        problems.append(f"{spec.prefix}: gate/up given both per expert (2D) and fused (3D)")
    if problems:
        raise ExpertLayoutError(
            f"Adapter {adapter!r}: MoE block {spec.prefix!r} does not fit the model "
            f"({spec.num_experts} experts, H={spec.hidden}, I={spec.intermediate}): " + "; ".join(problems[:5])
            + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "")
            + ". Check that the adapter was trained for this base model.",
            adapter=adapter, key=spec.prefix)
    return plan


# ------------------------------------------------------------------------------------------------
# reading


ExpertRead = Callable[[str, Sequence[tuple[int, int, int]] | None], torch.Tensor]
"""``read(key, ranges)``: the tensor, or with ``ranges = [(dim, start, stop), ...]`` only those slices
concatenated along ``dim`` (the reader touches no other rows/columns)."""


def _ranges(ids: Sequence[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for e in ids:
        if out and out[-1][1] == e:
            out[-1] = (out[-1][0], e + 1)
        else:
            out.append((e, e + 1))
    return out


Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
# SafetensorsReader.read_stacks: groups of keys -> each group stacked (memory from the callable), or None
ReadStacks = Callable[..., list[torch.Tensor | None]]
# SafetensorsReader.gather: (key, the pieces of the tensor's rows to keep, memory) -> the pieces concatenated
Gather = Callable[..., torch.Tensor]
# SafetensorsReader.read_transposed: (key, columns, memory, scale=, dtype=) -> the transposed matrix, or None
ReadTransposed = Callable[..., torch.Tensor | None]


def read_experts(plan: ExpertsPlan, read: ExpertRead, *, config: AdapterConfig, experts: Sequence[int] | None = None,
                 dtype: torch.dtype | None = None, read_many: Callable[[Sequence[str]], Mapping[str, torch.Tensor]] | None = None,
                 scaled: bool = True, check_finite_as: str | None = None, alloc: Alloc | None = None,
                 read_stacks: ReadStacks | None = None, keep_fused_gate_up: bool = False,
                 gather: Gather | None = None, read_transposed: ReadTransposed | None = None) -> ExpertsLoRA:
    """Read one planned MoE block for the kept ``experts`` (default: all) and normalize it.

    2D keys of other experts are never read; 3D tensors are read as row ranges of A and column
    ranges of B for the kept experts only. Scaling (``alpha/r`` or rsLoRA, rank/alpha patterns per
    projection) is folded into B in float32, then cast to ``dtype`` (``scaled=False``: B as stored).
    With ``check_finite_as`` (the adapter's name), factors holding NaN or infinity are refused
    while they are still hot in cache. With ``alloc``, stacked per-expert factors are written straight
    into memory it gives (a build process's shared file, a host arena), rather than into new tensors; a fused
    gate_up B too with ``keep_fused_gate_up`` (the model's wrapper keeps it fused, so it is not split later).
    With ``gather`` (`SafetensorsReader.gather`), a rank's columns of a 3D B are copied out of the file straight
    into their final order, once; with ``read_transposed`` (`SafetensorsReader.read_transposed`), all of a 3D B
    is, scaled on the way.

    Raises:
        [`AdapterFormatError`]: a factor holds NaN or infinity (names the block and projection).
    """
    spec = plan.spec
    keep = tuple(range(spec.num_experts)) if experts is None else tuple(experts)
    pos = {e: j for j, e in enumerate(keep)}
    n = len(keep)
    out = ExpertsLoRA(prefix=spec.prefix, experts=keep, intermediate=spec.intermediate, interleaved=spec.interleaved)

    # 2D: stack per role; only kept experts' keys are read. Views are stacked straight out of the
    # reader (one copy), then scaled per block in float32.
    by_role: dict[str, list[Key2D]] = {}
    for k in plan.keys_2d:
        if k.expert in pos:
            by_role.setdefault(k.role, []).append(k)
    uniform = not config.has_patterns
    for role in by_role:
        by_role[role].sort(key=lambda k: pos[k.expert])
    # A full set of experts of one rank: read stacked straight from the file (one copy per factor, no tensor per key)
    stacked: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if read_stacks is not None and uniform:
        whole = [role for role, ks in by_role.items() if len(ks) == n and len({k.rank for k in ks}) == 1]

        into = _memory(alloc, dtype)  # stacked straight into alloc's memory where the dtype is the one kept
        got = read_stacks([[getattr(k, f) for k in by_role[role]] for role in whole for f in ("key_a", "key_b")], into,
                          bundle=2) if whole else []
        for i, role in enumerate(whole):
            a, b = got[2 * i], got[2 * i + 1]
            if a is not None and b is not None:  # both or neither (bundle=2)
                stacked[role] = (a, b)
    wanted = [key for role, ks in by_role.items() if role not in stacked for k in ks for key in (k.key_a, k.key_b)]
    loaded = dict(read_many(wanted)) if read_many is not None else {key: read(key, None) for key in wanted}
    # (read_many may hand out views into a memory map: everything below copies out of them)
    for role, ks in by_role.items():
        r = max(k.rank for k in ks)
        name = _proj_name(spec, role)
        if role in stacked or uniform and len(ks) == n and all(k.rank == r for k in ks):
            s = config.scaling_for(f"{spec.prefix}.0.{name}", r) if scaled else 1.0
            if role in stacked:  # in alloc's memory where the dtypes allow it (``into`` above)
                a, b = stacked.pop(role)
            else:
                source_dtype = loaded[ks[0].key_a].dtype
                direct = alloc if dtype is None or dtype == source_dtype else None  # straight into alloc's memory
                a = _stack([loaded[k.key_a] for k in ks], direct)
                b = _stack([loaded[k.key_b] for k in ks], direct)
            target = dtype if dtype is not None else a.dtype
            # one rounding of s·B to the target dtype, computed in float32 either way (torch's opmath)
            b = b.mul_(s) if b.dtype == target else b.float().mul_(s)
            if alloc is None or a.dtype != target:  # not built in alloc's memory in the target dtype
                a, b = _into(a, alloc, target), _into(b, alloc, target)
            setattr(out, role, ExpertFactors(a, b))
            continue
        else:  # missing experts (no delta), mixed ranks or per-module patterns
            d_in = spec.intermediate if role == "down" else spec.hidden
            d_out = spec.hidden if role == "down" else spec.intermediate
            a = torch.zeros(n, r, d_in, dtype=torch.float32)
            b = torch.zeros(n, d_out, r, dtype=torch.float32)
            for k in ks:
                j = pos[k.expert]
                s = config.scaling_for(f"{spec.prefix}.{k.expert}.{name}", k.rank) if scaled else 1.0
                a[j, : k.rank] = loaded[k.key_a]
                b[j, :, : k.rank] = loaded[k.key_b].float() * s
        target = dtype if dtype is not None else a.dtype
        setattr(out, role, ExpertFactors(_into(a, alloc, target), _into(b, alloc, target)))
    del loaded

    # 3D: A rows [e·r, (e+1)·r) per kept expert, B columns {i·E + e}.
    e_all = spec.num_experts
    for k3 in plan.keys_3d:
        r = k3.rank
        exp_ranges = _ranges(keep)
        a_ranges = [(0, s * r, t * r) for s, t in exp_ranges]
        b_ranges = [(1, i * e_all + s, i * e_all + t) for i in range(r) for s, t in exp_ranges]
        full = n == e_all
        standard = k3.orientation == "standard"
        # A rank's share of B (its columns sit in every row) is copied once out of the file, straight into
        # (n, out, r) order, a block of rows at a time. All of a standard B is one transpose of its bytes as an
        # (out·r, E) matrix: read, transposed in cache and scaled into place a block at a time. (Gathering all of
        # it element by element, as a rank's share is, was slower than reading it whole and reordering it: dev VM,
        # 12-layer 3D adapter, fresh processes, 296 against 266 ms.)
        gathered = gather is not None and not full
        a_in_alloc = False
        a_file = b_file = None
        if full and read_stacks is not None:  # whole tensors: read with preadv, A straight into alloc's memory
            a_mem = _memory(alloc if standard else None, dtype)
            got_a = read_stacks([[k3.key_a]], a_mem)[0]
            a_file = got_a[0] if got_a is not None else None
            a_in_alloc = a_file is not None and a_mem is not None and dtype in (None, a_file.dtype)
        if a_file is None:
            a_file = read(k3.key_a, None if full else a_ranges)  # (n·r, in): whole rows
        target = dtype if dtype is not None else a_file.dtype
        a3 = a_file.reshape(n, r, a_file.shape[1])
        # A fused gate_up B is put in ``alloc`` only where it is kept fused (a 3D-wrapper model): a 2D-wrapper
        # model splits it into new tensors (which are).
        b_alloc = alloc if k3.role != "gate_up" or keep_fused_gate_up else None
        name = "gate_up_proj" if k3.role == "gate_up" else "down_proj"
        s = config.scaling_for(f"{spec.prefix}.{name}", r) if scaled else 1.0
        b_done = None  # all of a standard B, read, reordered to (n, out, r) and scaled in one pass over memory
        if full and standard and read_transposed is not None:
            b_done = read_transposed(k3.key_b, e_all, b_alloc, scale=s, dtype=target)
        if b_done is not None:
            b3 = b_done.view(n, -1, r)
            setattr(out, k3.role, ExpertFactors(a3 if a_in_alloc else _into(a3, alloc, target), b3))
            del a_file, a3, b3, b_done
            continue
        if full and read_stacks is not None:  # (a rank's share is gathered, below)
            got_b = read_stacks([[k3.key_b]])[0]
            b_file = got_b[0] if got_b is not None else None
        b_final = False  # b3 is already (n, out, r), contiguous, in the memory it is kept in
        if gathered:
            assert gather is not None
            b_mem = b_alloc if standard else None
            b3 = gather(k3.key_b, lambda t: [t.view(t.shape[0], r, e_all)[:, :, s:e].permute(2, 0, 1)
                                             for s, e in exp_ranges], _memory(b_mem, target))
            b_final = standard and (b_mem is None or b3.dtype == target)
        else:
            if b_file is None:
                b_file = read(k3.key_b, None if full else b_ranges)  # (out, r·n) ordered (i, e)
            b3 = b_file.reshape(b_file.shape[0], r, n).permute(2, 0, 1)  # (n, out, r)
        if k3.orientation == "transposed":  # stored ΔW_eᵀ = B_e A_e  ->  ΔW_e = A_eᵀ B_eᵀ
            a3, b3 = b3.transpose(1, 2), a3.transpose(1, 2)
        if b3.dtype == target:  # one copy into (n, out, r) order, then scale in place (float32 opmath)
            # (2x faster than torch.mul(b3, s, out=...) on this permuted view)
            if not b_final:
                b3 = _into_by_rows(b3, b_alloc) if standard else _into(b3, b_alloc)
            b3 = b3.mul_(s)
        else:
            b3 = _into(b3.float() * s, b_alloc, target)
        setattr(out, k3.role, ExpertFactors(a3 if a_in_alloc else _into(a3, alloc, target), b3))
        del a_file, b_file, a3, b3
    if check_finite_as is not None:
        check_finite(_factors(out), adapter=check_finite_as)
    return out


def _memory(alloc: Alloc | None, want: torch.dtype | None) -> Alloc | None:
    """Where a tensor read straight from the file goes (`read_stacks`, `gather`): ``alloc``'s memory if its dtype
    is the one kept (``want``; None: any), else a new tensor (converted later, by a copy into ``alloc``); None
    (new tensors) without ``alloc``."""
    if alloc is None:
        return None

    def memory(shape: tuple[int, ...], source: torch.dtype) -> torch.Tensor:
        return alloc(shape, source) if want in (None, source) else torch.empty(shape, dtype=source)

    return memory


def _into(t: torch.Tensor, alloc: Alloc | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` in ``dtype`` (default its own) as a contiguous tensor; with ``alloc``, always a copy in memory
    ``alloc`` gives, converted while copied (the same rounding as ``.to``)."""
    dtype = dtype or t.dtype
    if alloc is None:
        return t.to(dtype).contiguous()
    out = alloc(tuple(t.shape), dtype)
    out.copy_(t)
    return out


_ROW_BLOCK = 64  # rows of a fused B copied at a time (see `_into_by_rows`)


def _into_by_rows(t: torch.Tensor, alloc: Alloc | None) -> torch.Tensor:
    """``_into(t, alloc)`` for a fused B's ``(n, out, r)`` view of its file ``(out, r·n)`` rows, copied
    ``_ROW_BLOCK`` rows at a time: a block's source rows (64 × 4 KiB at r=16, 128 experts) stay in cache while
    every expert takes its ``r`` columns from them, instead of each expert's pass reading one element of
    every cache line of the whole tensor (dev VM, a (2048, 2048) bfloat16 B: 4.3 against 6.0 ms with the
    scaling after it). The same bytes as one copy."""
    out = alloc(tuple(t.shape), t.dtype) if alloc is not None else torch.empty(t.shape, dtype=t.dtype)
    for i in range(0, t.shape[1], _ROW_BLOCK):
        out[:, i:i + _ROW_BLOCK].copy_(t[:, i:i + _ROW_BLOCK])
    return out


def _stack(tensors: list[torch.Tensor], alloc: Alloc | None) -> torch.Tensor:
    if alloc is None:
        return torch.stack(tensors)
    return torch.stack(tensors, out=alloc((len(tensors), *tensors[0].shape), tensors[0].dtype))


def _factors(ex: ExpertsLoRA) -> dict[str, torch.Tensor]:
    return {f"{ex.prefix} {role} lora_{w}": getattr(f, w.lower())
            for role in ("gate_up", "gate", "up", "down") if (f := getattr(ex, role)) is not None for w in ("A", "B")}


def _proj_name(spec: MoESpec, role: str) -> str:
    return {"gate": spec.gate, "up": spec.up, "down": spec.down}[role]


def read_blocks(plans: Mapping[str, ExpertsPlan], read: ExpertRead, *, config: AdapterConfig,
                experts: Mapping[str, Sequence[int] | None] | None = None, dtype: torch.dtype | None = None,
                read_many: Callable[[Sequence[str]], Mapping[str, torch.Tensor]] | None = None,
                workers: int | None = None, check_finite_as: str | None = None,
                scan_workers: int | None = None, alloc: Alloc | None = None,
                read_stacks: ReadStacks | None = None,
                fused_gate_up: Mapping[str, bool] | None = None, gather: Gather | None = None,
                read_transposed: ReadTransposed | None = None) -> dict[str, ExpertsLoRA]:
    """Read several planned MoE blocks, ``workers`` at a time (torch ops release the GIL).

    Serving processes run torch with one intra-op thread, so blocks in parallel threads are what
    uses the host's cores. Results are in the order of ``plans``. ``fused_gate_up`` names the blocks whose
    fused gate_up stays fused (see [`read_experts`]). With ``check_finite_as``, a host
    with cores to spare scans each block for NaN/inf on a separate pool while the next blocks are
    read; otherwise each reader scans its own block.

    Raises:
        [`AdapterFormatError`]: a factor holds NaN or infinity (the first block in ``plans`` order).
    """
    import contextlib
    import os
    import threading
    from concurrent.futures import Future, wait

    from vllm_lora_ext._progress import ProgressLog
    from vllm_lora_ext.transport.pools import lent_pool, run_in_pool

    from vllm_lora_ext.validation import first_nonfinite, nonfinite_error

    items = list(plans.items())
    cores = os.cpu_count() or 1
    # measured on a 16-core H200 host: 4 threads 1.6 s, 1 thread 3.0 s, 8 threads 2.7 s (GIL contention)
    n = workers if workers is not None else min(4, cores, max(1, len(items)))
    if scan_workers is None:
        scan_workers = min(2, cores - n) if n > 1 and len(items) > 1 else 0
    scanning = check_finite_as is not None and scan_workers > 0
    scans: dict[str, Future[str | None]] = {}
    progress = ProgressLog(f"loading {check_finite_as or 'adapter'!r} ({len(items)} MoE blocks)")
    done = {"blocks": 0, "bytes": 0}
    lock = threading.Lock()

    with lent_pool("vllm-lora-ext-scan", scan_workers) if scanning else contextlib.nullcontext() as scan_pool:

        def one(item: tuple[str, ExpertsPlan]) -> ExpertsLoRA:
            prefix, plan = item
            ex = read_experts(plan, read, config=config, experts=(experts or {}).get(prefix), dtype=dtype,
                              read_many=read_many, check_finite_as=None if scan_pool is not None else check_finite_as,
                              alloc=alloc, read_stacks=read_stacks,
                              keep_fused_gate_up=bool((fused_gate_up or {}).get(prefix)), gather=gather,
                              read_transposed=read_transposed)
            factors = _factors(ex)
            if scan_pool is not None:
                scans[prefix] = scan_pool.submit(first_nonfinite, factors)
            with lock:  # bytes so far, against the blocks' share of the total
                done["blocks"] += 1
                done["bytes"] += sum(t.numel() * t.element_size() for t in factors.values())
                progress.update(done["bytes"], total=done["bytes"] * len(items) // done["blocks"])
            return ex

        try:
            if n <= 1 or len(items) <= 1:
                out = {p: one((p, pl)) for p, pl in items}
            else:  # (a failed block: the blocks not started are dropped, the running ones finish first)
                out = dict(zip((p for p, _ in items), run_in_pool("vllm-lora-ext-read", n, one, items)))
            for prefix, _ in items:
                bad = scans[prefix].result() if prefix in scans else None
                if bad is not None:
                    raise nonfinite_error(bad, adapter=check_finite_as or "adapter")
            return out
        finally:  # nothing of this read is left queued or running once it returns or raises
            for scan in scans.values():
                scan.cancel()
            wait(list(scans.values()))
