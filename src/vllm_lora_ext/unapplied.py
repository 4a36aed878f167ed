"""Modules vLLM accepts a LoRA for and never applies, by model trait: the refusal table.

A *trait* is a fact about how vLLM runs the base model that decides whether a LoRA on some module
reaches the output. The worker reports the running model's traits ([`ModelSpec.traits`], name ->
detail for messages); ``vllm-lora inspect`` derives them from the base model's ``config.json``.
An adapter with weights on such a module is refused before any tensor is read, naming the module,
the reason and the fix. ``VLLM_LORA_EXT_DROP_UNAPPLIED=<group>[,<group>]`` (never the default) drops
those weights instead, with a warning naming them: the adapter is then served without them.

| trait | module group | why vLLM does not apply the LoRA |
|---|---|---|
| ``mla`` | ``kv_b_proj`` | MLA attention computes ``W_UK``/``W_UV`` from ``kv_b_proj``'s weight when the model loads, and its prefill calls the base layer it was built with, not the LoRA wrapper (vLLM 0.26–0.33) |
| ``aliased`` | ``shared_expert_gate`` | the model calls the module through a second attribute that still holds the base layer, so the LoRA wrapper vLLM puts under the first name is never called (Qwen2-MoE: ``mlp.shared_expert.expert_gate`` is ``mlp.shared_expert_gate``; vLLM 0.26–0.33) |
| ``moe_kernel_drops_lora`` | ``experts`` | the quantized MoE kernel vLLM picked says it supports LoRA, but its ``apply`` never reads the LoRA context (``TritonWNA16Experts``: int4/int8 weight-only MoE through compressed-tensors; ``Mxfp8NativeTritonExperts``; ROCm's ``AiterMxfp8Experts``) |
| ``moe_kernel_misapplies_lora`` | ``experts`` | the MoE kernel vLLM picked (Marlin, for int4/int8 weight-only and some FP8 bases) runs the experts at an intermediate size padded to its tile (a multiple of 64 and of the group size), while vLLM's MoE LoRA buffers keep the unpadded size: the LoRA delta of ``up_proj``, the second half of ``gate_up``, is added at the wrong columns |

Pure core: names and rules only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_lora_ext.constants import ENV_DROP_UNAPPLIED, drop_unapplied
from vllm_lora_ext.errors import AdapterCompatibilityError

__all__ = ["ALIASED_MODEL_TYPES", "MLA_MODEL_TYPES", "MOE_KERNELS_DROPPING_LORA", "RULES", "TRAIT_ALIASED", "TRAIT_MLA",
           "TRAIT_MOE_KERNEL", "TRAIT_MOE_KERNEL_WRONG", "UnappliedRule",
           "find_unapplied", "int_weight_only", "kernel_traits", "padding_traits", "screen_unapplied", "traits_from_config", "unapplied_on_base",
           "unapplied_problems"]

logger = logging.getLogger(__name__)

TRAIT_MLA = "mla"
TRAIT_MOE_KERNEL = "moe_kernel_drops_lora"
TRAIT_MOE_KERNEL_WRONG = "moe_kernel_misapplies_lora"
TRAIT_ALIASED = "aliased"
# Model types whose vLLM model calls its shared expert's gate through a second attribute (``inspect``, no model).
ALIASED_MODEL_TYPES = frozenset({"qwen2_moe"})
EXPERTS = "experts"  # the module group of a rule that covers every routed-expert key of an MoE block

# The model types vLLM runs with MLA attention when the config has ``kv_lora_rank`` (vLLM 0.26–0.33,
# ``is_deepseek_mla``; ``VLLM_MLA_DISABLE=1`` turns MLA off). Used where there is no running model: inspect.
MLA_MODEL_TYPES = frozenset({
    "axk1", "bailing_hybrid", "bailing_hybrid_mtp", "bailing_hybrid_v3_mtp", "deepseek_mtp", "deepseek_v2",
    "deepseek_v3", "deepseek_v32", "deepseek_v4", "deepseek_v41", "dots3_note", "glm4_moe_lite", "glm4_moe_lite_mtp",
    "glm5_next", "glm5_next_text", "glm_moe_dsa", "hy_v4", "hy_v4_mtp", "k3_dspark", "kimi_k2", "kimi_linear",
    "longcat_flash", "longcat_flash_ngram", "pangu_ultra_moe", "pangu_ultra_moe_mtp",
})

# vLLM MoE expert kernels whose ``supports_lora()`` is true (inherited from ``TritonExperts``) but whose
# ``apply`` never reads the LoRA context: an expert LoRA on such a block is accepted and never applied.
MOE_KERNELS_DROPPING_LORA = frozenset({"TritonWNA16Experts", "Mxfp8NativeTritonExperts", "AiterMxfp8Experts"})


@dataclass(frozen=True)
class UnappliedRule:
    """One row of the refusal table.

    Attributes:
        trait: the model trait under which the rule holds (``"mla"``).
        group: the module group: a module's last name part (``"kv_b_proj"``), or ``"experts"`` for every
            routed-expert key of an MoE block. ``VLLM_LORA_EXT_DROP_UNAPPLIED`` names groups.
        reason: why vLLM does not apply such a LoRA (``{detail}``: the trait's detail).
        fix: what the user can do.
    """

    trait: str
    group: str
    reason: str
    fix: str

    def covers(self, module: str) -> bool:
        """Whether a dense module name falls under this rule (its last name part is the group)."""
        return self.group != EXPERTS and module.rsplit(".", 1)[-1] == self.group


RULES: tuple[UnappliedRule, ...] = (
    UnappliedRule(
        TRAIT_MLA, "kv_b_proj",
        "MLA folds kv_b_proj into its attention weights (vLLM computes W_UK/W_UV from the base weight when the model "
        "loads, and its prefill calls the base layer, not the LoRA wrapper), so vLLM accepts a LoRA on kv_b_proj and "
        "never applies it",
        "Retrain without kv_b_proj (PEFT LoraConfig target_modules listing the other modules, e.g. ['q_proj', "
        "'kv_a_proj_with_mqa', 'o_proj', ...], not 'all-linear')"),
    UnappliedRule(
        TRAIT_ALIASED, "shared_expert_gate",
        "vLLM's {detail} calls the shared expert's gate through a second attribute that still holds the base layer, "
        "so the LoRA wrapper vLLM installs on shared_expert_gate is never called and the LoRA never applied",
        "Retrain without shared_expert_gate (PEFT LoraConfig target_modules without it; 'all-linear' includes it)"),
    UnappliedRule(
        TRAIT_MOE_KERNEL, EXPERTS,
        "this quantized MoE base runs its experts with vLLM's {detail} kernel, which accepts expert LoRA weights and "
        "never applies them",
        "Serve the adapter on an unquantized base, or retrain it without expert modules"),
    UnappliedRule(
        TRAIT_MOE_KERNEL_WRONG, EXPERTS,
        "this quantized MoE base runs its experts with vLLM's {detail}: the kernel pads the experts' intermediate "
        "size to its tile, while vLLM's MoE LoRA buffers keep the unpadded size, so the LoRA delta of up_proj (the "
        "second half of gate_up) is added at the wrong columns and the experts are served other than as trained",
        "Serve the adapter on an unquantized base, or on a quantized one whose MoE intermediate size per "
        "tensor-parallel rank is a multiple of 64 and of its quantization group size (no padding), or retrain it "
        "without expert modules"),
)


def kernel_traits(kernels: Iterable[str]) -> dict[str, str]:
    """Return the trait implied by the experts kernels (class names) an MoE model runs: kernels that drop LoRA.

    Example:
        >>> kernel_traits(["TritonWNA16Experts", "TritonExperts"])
        {'moe_kernel_drops_lora': 'TritonWNA16Experts'}
        >>> kernel_traits(["MarlinExperts", "TritonExperts"])
        {}
    """
    dropping = sorted(set(kernels) & MOE_KERNELS_DROPPING_LORA)
    return {TRAIT_MOE_KERNEL: ", ".join(dropping)} if dropping else {}


def padding_traits(paddings: Iterable[tuple[str, int, int | None]]) -> dict[str, str]:
    """Return the trait implied by MoE blocks whose kernel runs the experts at another intermediate size than the
    LoRA buffers have: ``(kernel, LoRA size, kernel size or None where it could not be read)`` each.

    Example:
        >>> padding_traits([("MarlinExperts", 96, 128), ("MarlinExperts", 96, 128)])
        {'moe_kernel_misapplies_lora': 'MarlinExperts kernel (intermediate size 96 padded to 128)'}
        >>> padding_traits([])
        {}
    """
    found = sorted({f"{k} kernel (intermediate size {n} padded to {p})" if p is not None else
                    f"{k} kernel (whose intermediate size could not be read to check it against {n})"
                    for k, n, p in paddings})
    return {TRAIT_MOE_KERNEL_WRONG: "; ".join(found)} if found else {}


def traits_from_config(config: Mapping[str, Any]) -> dict[str, str]:
    """Return the traits a base model's ``config.json`` implies where no running model can be asked (``inspect``).

    MLA: a ``kv_lora_rank`` and a model type vLLM runs with MLA ([`MLA_MODEL_TYPES`]), as vLLM decides
    ``model_config.use_mla`` (the config of a multimodal model's text part counts too). Aliased: a model type
    whose shared expert calls its gate through a second attribute ([`ALIASED_MODEL_TYPES`]). An int weight-only
    MoE base ([`int_weight_only`]) whose experts' intermediate size Marlin would pad (not a multiple of 64 and of
    the group size, at tensor-parallel size 1): what the worker finds from the running kernel ([`padding_traits`]).

    Example:
        >>> traits_from_config({"model_type": "deepseek_v3", "kv_lora_rank": 512})
        {'mla': 'deepseek_v3'}
        >>> traits_from_config({"model_type": "minicpm3", "kv_lora_rank": 256})
        {}
        >>> traits_from_config({"model_type": "qwen2_moe", "shared_expert_intermediate_size": 5632})
        {'aliased': 'qwen2_moe'}
    """
    found: dict[str, str] = {}
    for part in (config, config.get("text_config") or {}):
        if not isinstance(part, Mapping):
            continue
        if part.get("kv_lora_rank") is not None and part.get("model_type") in MLA_MODEL_TYPES \
                and part.get("is_causal", True) is not False:
            found.setdefault(TRAIT_MLA, str(part["model_type"]))
        if part.get("model_type") in ALIASED_MODEL_TYPES and (part.get("shared_expert_intermediate_size") or 0) > 0:
            found.setdefault(TRAIT_ALIASED, str(part["model_type"]))
        padded = _marlin_padding(part, config.get("quantization_config") or config.get("compression_config")
                                 or part.get("quantization_config"))
        if padded:
            found.setdefault(TRAIT_MOE_KERNEL_WRONG, padded)
    return found


# Config keys that give an MoE model's routed-expert count, and its experts' intermediate size, by family.
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_EXPERT_SIZE_KEYS = ("moe_intermediate_size", "expert_intermediate_size", "intermediate_size")


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _marlin_padding(part: Mapping[str, Any], quant: Any) -> str | None:
    """How vLLM's Marlin kernel would pad this int weight-only MoE's experts at tensor-parallel size 1, or None."""
    weights = int_weight_only(quant)
    if weights is None or not any(_positive(part.get(k)) for k in _EXPERT_COUNT_KEYS):
        return None
    size = next((part[k] for k in _EXPERT_SIZE_KEYS if _positive(part.get(k))), None)
    if size is None:
        return None
    kind, group = weights
    tile = math.lcm(64, group if group > 0 else 1)
    padded = -(-size // tile) * tile
    return None if padded == size else (f"Marlin kernel (intermediate size {size} padded to {padded} at "
                                        f"tensor-parallel size 1; {kind})")


def int_weight_only(quant: Any) -> tuple[str, int] | None:
    """Describe a ``quantization_config`` whose weights are int4/int8 with 16-bit activations (GPTQ, AWQ,
    compressed-tensors W4A16/W8A16), the bases whose MoE experts vLLM runs with Marlin or Triton WNA16, and give
    its group size (-1: per channel); else None.

    Example:
        >>> int_weight_only({"quant_method": "gptq", "bits": 4, "group_size": 128})
        ('gptq int4', 128)
        >>> int_weight_only({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        ...     "weights": {"type": "int", "num_bits": 4, "group_size": 32}, "input_activations": None}}})
        ('compressed-tensors int4 weight-only', 32)
        >>> int_weight_only({"quant_method": "fp8"}) is None
        True
    """
    if not isinstance(quant, Mapping):
        return None
    method = str(quant.get("quant_method", "")).lower()
    if method in ("gptq", "awq", "gptq_marlin", "awq_marlin"):
        return f"{method} int{quant.get('bits', 4)}", _int(quant.get("group_size", quant.get("q_group_size")))
    if method != "compressed-tensors" or not isinstance(quant.get("config_groups"), Mapping):
        return None
    for group in quant["config_groups"].values():
        w = group.get("weights") if isinstance(group, Mapping) else None
        if isinstance(w, Mapping) and w.get("type") == "int" and w.get("num_bits") in (4, 8) \
                and not group.get("input_activations"):
            return f"compressed-tensors int{w['num_bits']} weight-only", _int(w.get("group_size"))
    return None


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def find_unapplied(modules: Iterable[str], moe_blocks: Iterable[str], traits: Mapping[str, str]
                   ) -> list[tuple[UnappliedRule, list[str]]]:
    """Return each rule that holds for ``traits`` with the modules (dense names, MoE block names) it covers.

    Example:
        >>> [(r.group, m) for r, m in find_unapplied(["l.0.kv_b_proj", "l.0.q_proj"], [], {"mla": "deepseek_v2"})]
        [('kv_b_proj', ['l.0.kv_b_proj'])]
    """
    dense, blocks = list(modules), list(moe_blocks)
    found: list[tuple[UnappliedRule, list[str]]] = []
    for rule in RULES:
        if rule.trait not in traits or any(r.group == rule.group for r, _ in found):
            continue  # one reason a group: two rules on the experts would name them twice
        hit = list(blocks) if rule.group == EXPERTS else [m for m in dense if rule.covers(m)]
        if hit:
            found.append((rule, hit))
    return found


def _describe(rule: UnappliedRule, traits: Mapping[str, str], names: list[str]) -> str:
    reason = rule.reason.format(detail=traits.get(rule.trait) or "its")
    return f"{rule.group} ({len(names)} module(s), first: {names[:3]}): {reason}"


def screen_unapplied(module_keys: Mapping[str, list[str]], moe_keys: Mapping[str, list[str]],
                     traits: Mapping[str, str], *, drop: frozenset[str] = frozenset(), adapter: str = "adapter",
                     identity: str = "") -> set[str]:
    """Refuse an adapter whose weights sit on modules vLLM accepts and never applies; return the keys to drop
    where the user opted in (``drop``, from ``VLLM_LORA_EXT_DROP_UNAPPLIED``), with a warning naming them.

    Args:
        module_keys: the adapter's dense keys by the model's module name.
        moe_keys: the adapter's routed-expert keys by the model's MoE block name.
        traits: the running model's traits.

    Raises:
        [`AdapterCompatibilityError`]: names each module group, the first few keys, the reason and the fix;
            or ``drop`` names a group no rule has.

    Example:
        >>> screen_unapplied({"l.0.kv_b_proj": ["k.lora_A.weight"]}, {}, {"mla": "deepseek_v2"}, adapter="a")
        Traceback (most recent call last):
        ...
        vllm_lora_ext.errors.AdapterCompatibilityError: Adapter 'a' has LoRA weights that vLLM would accept and not apply as trained on this model: kv_b_proj (1 module(s), first: ['l.0.kv_b_proj']): MLA folds kv_b_proj into its attention weights (vLLM computes W_UK/W_UV from the base weight when the model loads, and its prefill calls the base layer, not the LoRA wrapper), so vLLM accepts a LoRA on kv_b_proj and never applies it (first keys: ['k.lora_A.weight']). Retrain without kv_b_proj (PEFT LoraConfig target_modules listing the other modules, e.g. ['q_proj', 'kv_a_proj_with_mqa', 'o_proj', ...], not 'all-linear'); or set VLLM_LORA_EXT_DROP_UNAPPLIED=kv_b_proj to serve the adapter without these weights.
    """
    known = {r.group for r in RULES}
    if drop - known:
        raise AdapterCompatibilityError(
            f"{ENV_DROP_UNAPPLIED} names {sorted(drop - known)}, which no rule has. Use a comma-separated list of "
            f"{sorted(known)}, or unset it.", adapter=adapter)
    if not traits:
        return set()
    found = find_unapplied(module_keys, moe_keys, traits)
    refused = [(rule, names) for rule, names in found if rule.group not in drop]
    if refused:
        where = f" ({identity})" if identity else ""
        parts = []
        for rule, names in refused:
            keys = [k for n in names for k in (moe_keys if rule.group == EXPERTS else module_keys)[n]]
            parts.append(f"{_describe(rule, traits, names)} (first keys: {keys[:3]}). {rule.fix}")
        groups = ",".join(rule.group for rule, _ in refused)
        raise AdapterCompatibilityError(
            f"Adapter {adapter!r}{where} has LoRA weights that vLLM would accept and not apply as trained on this model: "
            + ". ".join(parts) + f"; or set {ENV_DROP_UNAPPLIED}={groups} to serve the adapter without these weights.",
            adapter=adapter)
    dropped: set[str] = set()
    for rule, names in found:
        keys = [k for n in names for k in (moe_keys if rule.group == EXPERTS else module_keys)[n]]
        logger.warning("Adapter %r: dropping %d LoRA tensors on %s because %s=%s is set; the adapter is served "
                       "WITHOUT them (%s).", adapter, len(keys), names[:3] + (["..."] if len(names) > 3 else []),
                       ENV_DROP_UNAPPLIED, rule.group, rule.reason.format(detail=traits.get(rule.trait) or "its"))
        dropped.update(keys)
    return dropped


def unapplied_problems(modules: Iterable[str], traits: Mapping[str, str], *,
                       dropped: frozenset[str] = frozenset()) -> list[str]:
    """Return one line per rule the adapter's modules fall under, for ``vllm-lora inspect``'s ``problem:`` lines.

    ``modules`` are the adapter's module names (PEFT's, ``base_model.model.`` removed); an MoE block's
    routed experts are named ``...experts`` or ``...experts.<n>.<proj>``. A rule whose group is in ``dropped``
    (``VLLM_LORA_EXT_DROP_UNAPPLIED``) is no problem: its line starts ``note:`` and says the load drops them.

    Example:
        >>> unapplied_problems(["model.layers.0.self_attn.kv_b_proj"], {"mla": "deepseek_v2"})[0][:40]
        'vLLM would accept but not apply as train'
    """
    dense, blocks = [], []
    for m in modules:
        head, sep, _ = m.partition(".experts")
        (blocks if sep else dense).append(head + sep if sep else m)
    lines = []
    for rule, names in find_unapplied(dense, dict.fromkeys(blocks), traits):
        what = f"vLLM would accept but not apply as trained this adapter's {_describe(rule, traits, names)}."
        if rule.group in dropped:
            lines.append(f"note: {what} {ENV_DROP_UNAPPLIED}={rule.group} is set: a load drops them with a warning.")
        else:
            lines.append(f"{what} {rule.fix}; or serve with {ENV_DROP_UNAPPLIED}={rule.group} to drop these weights "
                         f"with a warning.")
    return lines


def unapplied_on_base(modules: Iterable[str], config: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """The offline tools' reading of [`unapplied_problems`] for a base model's ``config.json``: its notes (rules
    ``VLLM_LORA_EXT_DROP_UNAPPLIED`` drops at load) and its problems (rules a load refuses), each in order."""
    lines = unapplied_problems(modules, traits_from_config(config), dropped=drop_unapplied())
    return [ln for ln in lines if ln.startswith("note: ")], [ln for ln in lines if not ln.startswith("note: ")]
