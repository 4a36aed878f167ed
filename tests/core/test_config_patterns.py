"""rank_pattern / alpha_pattern keys pick the rank and alpha PEFT's own ``get_pattern_key`` picks, key order included."""

from __future__ import annotations

import itertools

import pytest
from peft.utils.other import get_pattern_key

from vllm_lora_ext.config import config_from_dict

MODULES = [
    "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj", "model.layers.10.mlp.down_proj",
    "model.layers.3.mlp.experts.7.gate_proj", "q_proj", "model.layers.0.self_attn.qXproj", "xq_proj",
    "model.embed_tokens", "lm_head",
]
KEYS = [
    "q_proj", "v_proj", "layers.1.self_attn.v_proj", r"layers\.\d+\.self_attn\.q_proj", "q_proj|v_proj",
    "q.proj", r"experts\.\d+\.(gate|up)_proj", "mlp.*", "self_attn.(q|k)_proj", "lm_head", "0.self_attn.q_proj",
]


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))) + [None])
def test_each_module_gets_the_key_peft_picks_in_the_order_written(order: tuple[int, ...] | None) -> None:
    keys = KEYS if order is None else [KEYS[i] for i in order] + KEYS[3:] + KEYS[:3]
    keys = list(dict.fromkeys(keys))
    ranks = {k: i + 1 for i, k in enumerate(keys)}
    cfg = config_from_dict({"r": 64, "lora_alpha": 8, "rank_pattern": ranks, "alpha_pattern": dict(ranks)})
    for module in MODULES:
        peft_key = get_pattern_key(keys, module)
        expected = ranks.get(peft_key, 64)  # PEFT returns the module itself when no key matches
        assert cfg.rank_for(module) == expected, (module, keys)
        assert cfg.alpha_for(module) == (float(expected) if peft_key in ranks else 8.0), module


def test_an_earlier_regex_key_wins_over_a_later_exact_one_and_alternation_covers_the_whole_key() -> None:
    cfg = config_from_dict({"r": 8, "rank_pattern": {r"layers\.\d+\.self_attn\.q_proj": 4, "q_proj": 16,
                                                     "k_proj|v_proj": 2}})
    assert cfg.rank_for("model.layers.0.self_attn.q_proj") == 4  # PEFT: the first key in order that matches
    assert cfg.rank_for("model.layers.0.self_attn.v_proj") == 2  # (.*\.)?(k_proj|v_proj)$, not (.*\.)?k_proj|v_proj
    assert cfg.rank_for("model.layers.0.self_attn.o_proj") == 8
