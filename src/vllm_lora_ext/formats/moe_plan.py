"""Plans of MoE blocks: which key of a block plays which role (gate, up, down, gate_up), oriented how, at which rank.

Shapes only, no tensor is read: [`plan_experts`] checks every key of a block against the model's [`MoESpec`] and
says what does not fit. The layouts themselves are described in `vllm_lora_ext.formats.moe`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import repeat
from operator import itemgetter
from typing import Any, NamedTuple

from vllm_lora_ext.config import AdapterConfig
from vllm_lora_ext.errors import ExpertLayoutError
from vllm_lora_ext.formats import classify_key, spelled_in_name_order, strip_peft_prefix
from vllm_lora_ext.formats.moe import DOWN_NAMES, GATE_NAMES, UP_NAMES, MoESpec, Orientation, Role

__all__ = ["Key2D", "Key3D", "ExpertsPlan", "plan_experts"]


class Key2D(NamedTuple):
    """One expert's factor pair for one projection (a tuple: a 2D block has thousands)."""

    key_a: str
    key_b: str
    expert: int
    role: str  # gate / up / down
    rank: int


@dataclass(frozen=True)
class Key3D:
    """A fused (3D) factor pair of one MoE block: its role, how it is stored, and its rank per expert."""

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


_UNSETTLED = "read the same in standard and transposed orientation"


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
    heads = [f"{head}{e}." for e in experts]
    in_order = _in_name_order(shapes, head, projs, spec.num_experts)
    plan = ExpertsPlan(spec)
    spelled = 0
    for i, (proj, role) in enumerate(zip(projs, roles)):
        try:
            if in_order is not None:  # (the block's own keys: the spelled ones, found in order)
                keys_a, keys_b, got_a, got_b = in_order[i]
            else:
                keys_a = list(map(str.__add__, heads, repeat(f"{proj}.lora_A.weight")))
                keys_b = list(map(str.__add__, heads, repeat(f"{proj}.lora_B.weight")))
                got_a, got_b = list(map(shapes.__getitem__, keys_a)), list(map(shapes.__getitem__, keys_b))
            sa, sb = _one_shape(got_a), _one_shape(got_b)
        except (KeyError, TypeError):
            return None
        if sa is None or sb is None:
            return None
        d_in = spec.intermediate if role == "down" else spec.hidden
        d_out = spec.hidden if role == "down" else spec.intermediate
        if len(sa) != 2 or sa != (sa[0], d_in) or sb != (d_out, sa[0]):
            return None
        # (tuple.__new__ makes each Key2D as its own constructor does, without a Python call per key)
        plan.keys_2d += map(tuple.__new__, repeat(Key2D), zip(keys_a, keys_b, experts, repeat(role), repeat(sa[0])))
        spelled += 2 * len(keys_a)
    # Every key spelled is in the block, all are distinct (one per projection, expert and factor) and as many
    # as the block has: they are the block.
    return plan if spelled == len(shapes) else None


def _in_name_order(shapes: Mapping[str, tuple[int, ...]], head: str, projs: list[str],
                   num_experts: int) -> list[tuple[list[str], list[str], list[Any], list[Any]]] | None:
    """Where the block's keys are exactly the ones its ``head``, ``projs`` and experts spell, in the order of their
    names (as safetensors writes a file: experts ``0, 1, 10, 100, ...``), each projection's keys of A and of B by
    expert and their shapes, found by one comparison of the key lists rather than a lookup per key; else ``None``.

    ``projs`` are sorted and a key's expert number is followed by a dot, which sorts before every digit: the
    names sort by expert number as text, then projection, then factor.
    """
    tails = [f".{proj}.lora_{which}.weight" for proj in projs for which in "AB"]
    names = list(shapes)
    if not spelled_in_name_order(names, [head], num_experts, tails):
        return None
    order = sorted(range(num_experts), key=str)
    values = list(shapes.values())
    at = [0] * num_experts  # each expert's place in ``order``
    for place, e in enumerate(order):
        at[e] = place
    by_expert = itemgetter(*at) if num_experts > 1 else lambda row: (row[0],)
    step = len(tails)
    return [(list(by_expert(names[i::step])), list(by_expert(names[i + 1::step])), values[i::step],
             values[i + 1::step]) for i in range(0, step, 2)]


def _one_shape(shapes: list[Any]) -> tuple[int, ...] | None:
    """The one shape all of ``shapes`` are, as a tuple (a caller's shapes may be lists), or ``None`` if they are not
    all one; counted against the first where it is a tuple, which is quicker than a set of them."""
    first = shapes[0]
    if type(first) is tuple and shapes.count(first) == len(shapes):
        return first
    found = set(map(tuple, shapes))
    return found.pop() if len(found) == 1 else None


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
    plan = ExpertsPlan(spec)
    problems: list[str] = []
    seen_roles: dict[str, str] = {}  # role -> "2d" or "3d", the form that gave it
    threed = _plan_2d(shapes, plan, problems, seen_roles)
    _plan_3d(shapes, threed, _orientation_hint(config), plan, problems, seen_roles)
    for k3 in plan.keys_3d if config is not None and not config.inferred else ():  # r·E rows: r is the config's
        info = classify_key(k3.key_a)  # (an inferred config's r came from these very rows)
        prefix = info.experts_prefix or info.module
        declared = declared_3d_ranks(config, info.module, prefix) | {config.rank_for(prefix)}  # (gate_up: .base_layer)
        if declared and k3.rank not in declared:
            problems.append(f"{info.module}: 3D A has {shapes[k3.key_a][0]} rows, {k3.rank} per expert with the "
                            f"model's E={spec.num_experts}, but the adapter config's r is {min(declared)}: the "
                            f"adapter was made for {shapes[k3.key_a][0] / min(declared):g} experts")
    if any(k.role in ("gate", "up") for k in plan.keys_2d) and any(k.role == "gate_up" for k in plan.keys_3d):
        problems.append(f"{spec.prefix}: gate/up given both per expert (2D) and fused (3D)")
    if problems:
        unsettled = all(_UNSETTLED in p for p in problems)  # the shapes fit; only their orientation is open
        raise ExpertLayoutError(
            f"Adapter {adapter!r}: MoE block {spec.prefix!r} " + ("cannot be read unambiguously" if unsettled else
                                                                  "does not fit the model")
            + f" ({spec.num_experts} experts, H={spec.hidden}, I={spec.intermediate}): " + "; ".join(problems[:5])
            + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "")
            + ("." if unsettled else ". Check that the adapter was trained for this base model."),
            adapter=adapter, key=spec.prefix)
    return plan


def declared_3d_ranks(config: AdapterConfig, module: str, prefix: str) -> set[int]:
    """The ranks the config may give a fused 3D factor: by its module's name or by the fused parameter's
    (``<experts>.gate_up_proj``, ``<experts>.down_proj``; ``rank_pattern`` may name either, PEFT's
    ``target_parameters``). A fused factor has ``r × E`` rows for one of them."""
    return {config.rank_for(n) for n in (module, f"{prefix}.gate_up_proj", f"{prefix}.down_proj")}


def _plan_2d(shapes: Mapping[str, tuple[int, ...]], plan: ExpertsPlan, problems: list[str],
             seen_roles: dict[str, str]) -> list[tuple[str, str, str]]:
    """Pair the block's keys, plan the per-expert (2D) pairs into ``plan`` and return the fused ones
    ``(module, key A, key B)``; what does not fit goes to ``problems``."""
    spec = plan.spec
    pairs: dict[str, dict[str, str]] = {}
    infos: dict[str, Any] = {}
    for key in shapes:
        info = infos[key] = classify_key(key)
        other = pairs.setdefault(info.module, {}).setdefault(info.which, key)
        if other != key:  # one spelled with PEFT's prefix and one without: neither may be dropped silently
            problems.append(f"{info.module}: two keys hold its lora_{info.which}, {other!r} and {key!r}; keep one")
    taken: dict[tuple[int, str], str] = {}  # (expert, role) -> its module: "01" and "1" are one expert
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
            first = taken.setdefault((info.expert, role), module)
            if first != module:
                problems.append(f"{module}: expert {info.expert}'s {role} is also given as {first!r}; keep one")
                continue
            plan.keys_2d.append(Key2D(pair["A"], pair["B"], info.expert, role, r))
            seen_roles.setdefault(role, "2d")
        else:
            threed.append((module, pair["A"], pair["B"]))
    return threed


def _plan_3d(shapes: Mapping[str, tuple[int, ...]], threed: list[tuple[str, str, str]], hint: Orientation | None,
             plan: ExpertsPlan, problems: list[str], seen_roles: dict[str, str]) -> None:
    """Plan the fused (3D) pairs into ``plan``, their roles decided by shape (with two tensors, each must take a
    different role) and their orientation by shape, else by ``hint``; what does not fit goes to ``problems``."""
    spec = plan.spec
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
                    f"{module}: 3D {role} shapes A{sa} B{sb} {_UNSETTLED} "
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
