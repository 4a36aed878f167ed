"""vLLM's own adapter-key parsing as the core's `KeyRouter` (used by the worker's loader and the build process)."""

from __future__ import annotations

from typing import Any

from vllm_lora_ext.integration._compat import mapper_ignores_expert_numbers

__all__ = ["VllmKeyRouter"]

# Tensors vLLM itself drops on purpose (the base embedding copies PEFT saves with trainable tokens).
_BASE_EMBEDDING_SUFFIXES = (".embed_tokens.base_layer.weight", ".lm_head.base_layer.weight")


class VllmKeyRouter:
    """vLLM's own key parsing (``parse_fine_tuned_lora_name`` with the model's mapper), as a core `KeyRouter`."""

    def __init__(self, mapper: Any, skip_prefixes: list[str] | None) -> None:
        self.mapper = mapper
        self.skip_prefixes = skip_prefixes

    def __eq__(self, other: object) -> bool:
        """Routers with equal mappers and skipped prefixes answer every key alike (so a build's kept plan, made
        with one, holds for the other: ``building._planned``)."""
        return (type(other) is type(self) and list(other.skip_prefixes or ()) == list(self.skip_prefixes or ())
                and _in_order(other.mapper) == _in_order(self.mapper))

    def __hash__(self) -> int:
        return hash(tuple(self.skip_prefixes or ()))

    def skip(self, key: str) -> bool:
        from vllm.lora.utils import is_base_embedding_weights

        if is_base_embedding_weights(key) or key.endswith(_BASE_EMBEDDING_SUFFIXES):
            return True
        return bool(self.skip_prefixes) and _skipped(key, self.skip_prefixes or [])

    def module(self, key: str) -> str | None:
        from vllm.lora.utils import parse_fine_tuned_lora_name

        try:
            return str(parse_fine_tuned_lora_name(key, self.mapper)[0])
        except ValueError:
            return None

    def routes_experts_alike(self) -> bool:
        """Whether per-expert keys that differ only in the expert number get the same answers (see
        `plan_adapter`): the mapper and the skipped prefixes hold no rule that could tell them apart."""
        prefixes = self.skip_prefixes or []
        return (mapper_ignores_expert_numbers(self.mapper)
                and not any(any(c.isdigit() for c in p) for p in prefixes))


def _in_order(mapper: Any) -> Any:
    """A mapper's rules with their order (a ``WeightsMapper`` applies them in order; its dataclass equality does not
    see it)."""
    if mapper is None or not hasattr(mapper, "__dict__"):
        return mapper
    return type(mapper), [(k, list(v.items()) if isinstance(v, dict) else v) for k, v in sorted(vars(mapper).items())]


def _skipped(key: str, prefixes: list[str]) -> bool:
    bare = key.removeprefix("base_model.model.")
    return any(f".{p}" in bare or bare.startswith(p) for p in prefixes)
