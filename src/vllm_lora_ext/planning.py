"""Adapter plans: which model module every checkpoint key lands on, and every check before a tensor is read.

Pure core (no vLLM): `plan_adapter` takes the running model as plain data ([`ModelSpec`]) and vLLM's key
parser as a [`KeyRouter`]; the worker loader executes the plan (reads, vLLM objects) in a few lines.
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from vllm_lora_ext.config import AdapterConfig
from vllm_lora_ext.errors import UnmatchedKeysError
from vllm_lora_ext.formats import KeyInfo, classify_key, expert_key_splits, strip_peft_prefix
from vllm_lora_ext.formats.moe import MoESpec
from vllm_lora_ext.formats.moe_plan import ExpertsPlan, plan_experts
from vllm_lora_ext.unapplied import screen_unapplied
from vllm_lora_ext.validation import (ModuleDims, check_declared_ranks, check_dense_factors, check_factor_dtypes,
                                      check_has_factors, check_ranks)

__all__ = ["AdapterPlan", "KeyRouter", "ModelSpec", "PeftKeyRouter", "expert_pattern", "find_unmatched", "plan_adapter",
           "routes_experts_alike", "same_layer_block"]

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^(.*\.layers\.\d+)\.")


def find_unmatched(module_names: Iterable[str], accepted: set[str], *, pooling: bool = False) -> list[str]:
    """Return the module names that match no accepted module, in order.

    Example:
        >>> find_unmatched(["a.q_proj", "a.x_proj"], {"a.q_proj"})
        ['a.x_proj']
    """
    out = []
    for m in module_names:
        if m in accepted:
            continue
        if pooling and ("model." + m) in accepted:
            continue
        out.append(m)
    return out


def same_layer_block(prefix: str, blocks: Iterable[str]) -> str:
    """Map an experts block the model does not have to the model's only MoE block in the same layer.

    transformers v5 renamed some MoE blocks (Mixtral ``block_sparse_moe`` -> ``mlp``), so PEFT adapters
    trained on v5 name ``model.layers.N.mlp.experts`` where vLLM has ``...block_sparse_moe.experts``.
    Shapes are still checked against that block, so a wrong match fails loudly.

    Example:
        >>> same_layer_block("model.layers.3.mlp.experts", ["model.layers.3.block_sparse_moe.experts"])
        'model.layers.3.block_sparse_moe.experts'
    """
    blocks = list(blocks)
    if prefix in blocks:
        return prefix
    m = _LAYER.match(prefix)
    if not m:
        return prefix
    same = [b for b in blocks if b.startswith(m.group(1) + ".")]
    if len(same) == 1:
        logger.debug("experts block %r mapped to the model's %r", prefix, same[0])
        return same[0]
    return prefix


# ------------------------------------------------------------------------------------------------ adapter plans


class KeyRouter(Protocol):
    """How the running model names a checkpoint key (the worker supplies vLLM's own parser)."""

    def skip(self, key: str) -> bool:
        """Whether vLLM drops this key on purpose (base embedding copies, skipped prefixes)."""

    def module(self, key: str) -> str | None:
        """The model's module name for a LoRA key, or ``None`` if the key is not a LoRA weight."""


def routes_experts_alike(router: KeyRouter) -> bool:
    """Whether ``router`` decides alike for per-expert keys that differ only in the expert number.

    A router says so with a ``routes_experts_alike()`` method returning ``True``; then
    [`plan_adapter`] asks it about one key per MoE block, projection and factor, not about each of
    an MoE adapter's ~37k keys. Routers without the method are asked about every key.
    """
    method = getattr(router, "routes_experts_alike", None)
    return bool(method()) if callable(method) else False


def expert_pattern(key: str, info: KeyInfo) -> tuple[str, str] | None:
    """Split a per-expert (2D) key around its expert number: the keys of one block, projection and factor
    give the same pair, and any two keys giving the same pair differ in the expert number only.

    Example:
        >>> expert_pattern(k := "base_model.model.m.layers.0.mlp.experts.12.up_proj.lora_A.weight", classify_key(k))
        ('base_model.model.m.layers.0.mlp.experts.', '.up_proj.lora_A.weight')
    """
    if info.kind != "moe_2d" or info.experts_prefix is None or info.proj is None:
        return None
    start = len(key) - len(strip_peft_prefix(key)) + len(info.experts_prefix) + 1  # where the expert number begins
    digits = len(info.module) - len(info.experts_prefix) - len(info.proj) - 2
    return key[:start], key[start + digits:]


class PeftKeyRouter:
    """A router for models whose module names are PEFT's with ``base_model.model.`` removed (tests, offline).

    Example:
        >>> PeftKeyRouter().module("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
        'model.layers.0.self_attn.q_proj'
    """

    def __eq__(self, other: object) -> bool:  # no state: any two route alike
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(PeftKeyRouter)

    def skip(self, key: str) -> bool:
        return False

    def module(self, key: str) -> str | None:
        info = classify_key(key)
        return None if info.kind == "other" else info.module

    def routes_experts_alike(self) -> bool:
        return True


@dataclass(frozen=True)
class ModelSpec:
    """What a plan needs to know about the running model, as plain data.

    Attributes:
        accepted: every module name the model accepts LoRA weights for (constituents of packed modules too).
        dims: full input/output sizes of dense modules, where known.
        moe: the MoE blocks, by module name.
        local_experts: per MoE block, the global expert ids this rank holds, in local order.
        max_rank: ``--max-lora-rank``.
        pooling: a pooling model (vLLM's names then lack the ``model.`` prefix).
        traits: how vLLM runs the model where that decides whether a LoRA is applied (``{"mla": ...}``), see
            [`unapplied`]; adapters with weights on modules vLLM would accept and not apply as trained are refused.
        drop_unapplied: module groups whose never-applied weights are dropped with a warning instead
            (``VLLM_LORA_EXT_DROP_UNAPPLIED``).
        allow_unmatched: keys that match no module are dropped with a warning instead of refused
            (``VLLM_LORA_EXT_ALLOW_UNMATCHED_KEYS``).
        packed: each packed dense module and its constituents (``qkv_proj``: ``q_proj``, ``k_proj``, ``v_proj``);
            vLLM packs the constituents' factors over the packed module's own, so an adapter may give one or the
            other, not both.
    """

    accepted: frozenset[str]
    dims: Mapping[str, ModuleDims] = field(default_factory=dict)
    moe: Mapping[str, MoESpec] = field(default_factory=dict)
    local_experts: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    max_rank: int = 16
    pooling: bool = False
    traits: Mapping[str, str] = field(default_factory=dict)
    drop_unapplied: frozenset[str] = frozenset()
    allow_unmatched: bool = False
    packed: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass
class AdapterPlan:
    """Everything a loader needs before it reads a tensor: which dense keys, which MoE blocks, how.

    Attributes:
        dense_keys: dense LoRA keys to read, in file order.
        module_of: each dense key's module name in the model.
        moe: per MoE block (model name), the plan that assigns each key a role and orientation.
        dropped: keys matching no module, dropped because ``VLLM_LORA_EXT_ALLOW_UNMATCHED_KEYS`` is set, and keys
            on modules vLLM would never apply, dropped because ``VLLM_LORA_EXT_DROP_UNAPPLIED`` names them.
    """

    dense_keys: list[str]
    module_of: dict[str, str]
    moe: dict[str, ExpertsPlan]
    dropped: list[str] = field(default_factory=list)


def plan_adapter(shapes: Mapping[str, tuple[int, ...]], config: AdapterConfig, model: ModelSpec, *,
                 router: KeyRouter, dtypes: Mapping[str, str] | None = None, name: str = "adapter",
                 identity: str = "") -> AdapterPlan:
    """Route every key of an adapter to the model and check everything that can be checked without its tensors.

    In order: factor dtypes; ranks against ``max_rank``; every key to a module or an MoE block (a
    transformers-v5 block name goes to the only MoE block of its layer); keys that match nothing
    (refused, or dropped where ``model.allow_unmatched``); keys on modules vLLM would accept and not apply as trained
    ([`screen_unapplied`]: refused, or dropped where ``model.drop_unapplied`` names them); dense factor pairs,
    ranks and dims; every MoE block's roles and orientations by shape.

    Raises:
        [`AdapterFormatError`]: a dtype, a factor pair or a dim is wrong.
        [`UnmatchedKeysError`]: keys match no module (all of them in ``keys``).
        [`ExpertLayoutError`]: an MoE block does not fit the model.
        [`AdapterCompatibilityError`]: a rank exceeds ``max_rank``, or keys sit on modules vLLM never applies.

    Example:
        >>> from vllm_lora_ext.config import config_from_dict
        >>> spec = ModelSpec(frozenset({"m.q_proj"}), {"m.q_proj": ModuleDims(16, 16)})
        >>> shapes = {"base_model.model.m.q_proj.lora_A.weight": (4, 16), "base_model.model.m.q_proj.lora_B.weight": (16, 4)}
        >>> plan_adapter(shapes, config_from_dict({"r": 4}), spec, router=PeftKeyRouter()).module_of
        {'base_model.model.m.q_proj.lora_A.weight': 'm.q_proj', 'base_model.model.m.q_proj.lora_B.weight': 'm.q_proj'}
    """
    check_has_factors(shapes, adapter=name)
    if dtypes is not None:
        check_factor_dtypes(dtypes, adapter=name)
    check_ranks(shapes, [config.r, *config.rank_pattern.values()], model.max_rank, adapter=name)
    keys = list(shapes)
    routes = _route_keys(keys, shapes, model, router)
    dense_keys, module_of, modules, moe_groups = routes.dense_keys, routes.module_of, routes.modules, routes.moe_groups
    dropped: list[str] = []
    if model.traits or model.drop_unapplied:
        drop = _screen(modules, moe_groups, model, name=name, identity=identity)
        if drop:
            dropped = [k for k in keys if k in drop]
            dense_keys = [k for k in dense_keys if k not in drop]
            module_of = {k: m for k, m in module_of.items() if k not in drop}
            modules = {m: ks for m, ks in modules.items() if not drop.issuperset(ks)}
            moe_groups = {p: g for p, g in moe_groups.items() if not drop.issuperset(g)}
    unmatched = routes.not_lora + routes.moe_unmatched + [
        k for m in find_unmatched(modules, set(model.accepted), pooling=model.pooling) for k in modules[m]]
    if unmatched:
        where = f" ({identity})" if identity else ""
        msg = (f"Adapter {name!r}{where} has {len(unmatched)} keys that match no LoRA module of the base model "
               f"(first: {unmatched[:3]}). Check that the adapter was trained for this base model and that vLLM "
               f"wraps those modules (--lora-target-modules, --enable-lora for MoE); run 'vllm-lora inspect' on it.")
        if not model.allow_unmatched:
            raise UnmatchedKeysError(msg, adapter=name, keys=unmatched)
        logger.warning("%s Dropping them because VLLM_LORA_EXT_ALLOW_UNMATCHED_KEYS is set.", msg)
        dropped = dropped + unmatched
        bad = set(unmatched)
        dense_keys = [k for k in dense_keys if k not in bad]
        module_of = {k: m for k, m in module_of.items() if k not in bad}
    check_dense_factors(shapes, dense_keys, model.dims, module_of=module_of, adapter=name, packed=model.packed)
    plans = {prefix: plan_experts(group, model.moe[prefix], config=config, adapter=name)
             for prefix, group in moe_groups.items()}
    served = {k: shapes[k] for k in [*dense_keys, *(k for group in moe_groups.values() for k in group)]}
    check_declared_ranks(served, config, adapter=name)  # a 2D factor of another rank than its config's: PEFT refuses
    # it, and served it would be scaled by the config's lora_alpha / r
    return AdapterPlan(dense_keys, module_of, plans, dropped)


@dataclass
class _Routes:
    """Where the keys of an adapter go, before any is dropped or refused."""

    dense_keys: list[str] = field(default_factory=list)  # in file order
    modules: dict[str, list[str]] = field(default_factory=dict)  # dense module -> its keys
    module_of: dict[str, str] = field(default_factory=dict)  # dense key -> its module
    moe_groups: dict[str, dict[str, tuple[int, ...]]] = field(default_factory=dict)  # the model's block -> its shapes
    not_lora: list[str] = field(default_factory=list)  # keys the router says are no LoRA weight
    moe_unmatched: list[str] = field(default_factory=list)  # expert keys of a block the model does not have


def _route_keys(keys: list[str], shapes: Mapping[str, tuple[int, ...]], model: ModelSpec,
                router: KeyRouter) -> _Routes:
    """Ask ``router`` where each key goes (once per block, projection and factor for per-expert keys where it
    routes experts alike), skipping the keys it drops on purpose."""
    routes = _Routes()
    block_of: dict[str, str] = {}  # experts prefix in the file -> the model's block (one routing per prefix)
    alike = routes_experts_alike(router)
    answers: dict[object, str] = {}  # per-expert key pattern -> "skip", "other" or "lora"

    def ask(key: str) -> tuple[str, str | None]:
        if router.skip(key):
            return "skip", None
        module = router.module(key)
        return ("other" if module is None else "lora"), module

    def block_group(experts_prefix: str) -> dict[str, tuple[int, ...]] | None:
        """The group of the model's block that keys of ``experts_prefix`` go to (routed once), or ``None``."""
        prefix = block_of.get(experts_prefix)
        if prefix is None:
            routed = router.module(f"{experts_prefix}.lora_A.weight") or experts_prefix
            prefix = block_of[experts_prefix] = same_layer_block(routed, model.moe)
        return routes.moe_groups.setdefault(prefix, {}) if prefix in model.moe else None

    # Plain per-expert keys are split around their expert number in one pass, and the router is asked once per
    # block, projection and factor: per key, what is left is a lookup of its pattern (the split) and one insert.
    splits = expert_key_splits(keys) if alike else None
    split_answers: dict[tuple[str, str], str] = {}  # per split pattern, as `answers`
    groups: dict[str, dict[str, tuple[int, ...]] | None] = {}  # per split head (experts prefix, with PEFT's if any)
    for key, split in zip(keys, splits if splits is not None else itertools.repeat(("", ""))):
        head = split[0]
        if head:
            verdict = split_answers.get(split)
            if verdict is None:
                verdict = split_answers[split] = ask(key)[0]
            if verdict == "lora":
                group = groups.get(head, False)
                if group is False:
                    group = groups[head] = block_group(strip_peft_prefix(head)[:-1])
                if group is not None:
                    group[key] = shapes[key]
                else:
                    routes.moe_unmatched.append(key)
            elif verdict == "other":
                routes.not_lora.append(key)
            continue
        info = classify_key(key)
        pattern = expert_pattern(key, info) if alike else None
        module: str | None = None
        if pattern is not None and pattern in answers:  # a per-expert key like one the router has answered for
            verdict = answers[pattern]
        else:
            verdict, module = ask(key)
            if pattern is not None:
                answers[pattern] = verdict
        if verdict == "skip":
            continue
        if verdict == "other":
            routes.not_lora.append(key)
            continue
        if info.kind in ("moe_2d", "moe_3d") and info.experts_prefix is not None:
            group = block_group(info.experts_prefix)
            if group is not None:
                group[key] = tuple(shapes[key])
            else:
                routes.moe_unmatched.append(key)
            continue
        assert module is not None  # not a per-expert key: the router was asked about this one
        routes.modules.setdefault(module, []).append(key)
        routes.module_of[key] = module
        routes.dense_keys.append(key)
    return routes


def _screen(modules: Mapping[str, list[str]], moe_groups: Mapping[str, Mapping[str, tuple[int, ...]]],
            model: ModelSpec, *, name: str, identity: str) -> set[str]:
    """[`screen_unapplied`] over a plan's routed keys (only those on modules the model accepts)."""
    unmatched = set(find_unmatched(modules, set(model.accepted), pooling=model.pooling))  # refused as unmatched
    return screen_unapplied({m: ks for m, ks in modules.items() if m not in unmatched},
                            {p: list(g) for p, g in moe_groups.items()}, model.traits,
                            drop=model.drop_unapplied, adapter=name, identity=identity)
