"""Key routing rules shared by every loader: which model module a checkpoint name lands on.

Pure core (no vLLM): the worker loader asks these questions with the running model's module names.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

__all__ = ["find_unmatched", "same_layer_block"]

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
