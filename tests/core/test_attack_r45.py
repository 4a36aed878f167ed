"""Attacker pass r45 on the core: pattern keys the plugin read otherwise than PEFT, and adapter names no engine can send.

- ``rank_pattern``/``alpha_pattern`` keys are matched with the ``regex`` engine (for its timeout), PEFT matches them with
  ``re`` and its own pattern ``(.*\\.)?({key})$``. Before r45 the plugin compiled ``(.*\\.)?(?:{key})`` and
  full-matched it, so four kinds of key gave modules another alpha than PEFT trained them with, silently: a fuzzy
  constraint (``q_proj{e<=1}``: a literal brace to ``re``, "one edit away" to ``regex``, so ``k_proj`` and ``o_proj``
  took the pattern's alpha), a POSIX class (``[[:alpha:]]``), a back-reference or condition (one group fewer in the
  plugin's pattern), and a key that closes PEFT's group (``)|(``: PEFT's pattern splits into alternatives).
- An adapter name holding a lone surrogate (``"\\ud800"`` in a JSON body) was accepted by the name rule; vLLM's engine
  client cannot send it (msgpack), and the residency gauge labelled with it made every ``/metrics`` scrape fail.
"""

from __future__ import annotations

from typing import Any

import pytest

from vllm_lora_ext.config import config_from_dict
from vllm_lora_ext.errors import AdapterFormatError, AdapterSourceError
from vllm_lora_ext.naming import check_adapter_name

MODULES = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.o_proj",
           "model.layers.1.self_attn.q_proj", "model.layers.0.mlp.up_proj", "model.layers.10.mlp.down_proj"]

KEYS = [
    "q_proj{e<=1}",  # regex: fuzzy (k_proj, o_proj match); re: a literal brace (nothing matches)
    "(?:q_proj){e<=1}",
    "(?:self_attn\\.q_proj){e<=2}",
    "[[:alpha:]]_proj",  # regex: a POSIX class; re: the set '[:alph' then ']'
    "(q)?(?(2)_proj|k_proj)",  # group 2 is PEFT's own (open) group, the plugin's (q)
    "q_proj)|(zzz",  # closes PEFT's group: its first alternative has no '$'
    ")|(?>",
]


def _peft_alpha(key: str, module: str, alpha: float, default: float) -> float:
    from peft.utils.other import get_pattern_key

    return alpha if get_pattern_key([key], module) == key else default


@pytest.mark.parametrize("key", KEYS, ids=[f"key{i}" for i in range(len(KEYS))])
def test_a_pattern_key_gives_each_module_the_alpha_peft_gives_it_or_is_refused(key: str) -> None:
    pytest.importorskip("peft")
    try:
        config = config_from_dict({"r": 4, "lora_alpha": 8, "alpha_pattern": {key: 64}}, name="a")
    except AdapterFormatError as err:  # refused: the message names the key and the fix
        assert "alpha_pattern key" in str(err) and "adapter_config.json" in str(err), err
        return
    got = {m: config.alpha_for(m) for m in MODULES}
    assert got == {m: _peft_alpha(key, m, 64.0, 8.0) for m in MODULES}


@pytest.mark.parametrize("key", ["q_proj{e<=1}", "[[:alpha:]]_proj"])
def test_a_key_the_two_regex_engines_read_differently_is_refused_naming_why(key: str) -> None:
    with pytest.raises(AdapterFormatError, match="Write the module name") as info:
        config_from_dict({"r": 4, "lora_alpha": 8, "rank_pattern": {key: 8}}, name="a")
    assert repr(key) in str(info.value) and "regex engine" in str(info.value)


@pytest.mark.parametrize("key", ["q_proj", "layers\\.[0-9]{1,2}\\.self_attn\\.q_proj", "(q|k)_proj",
                                 "model.layers.0.self_attn.q_proj", "(a)\\3", "layers\\.(0)\\.self_attn\\.(q)_proj"])
def test_ordinary_keys_still_match_as_peft_matches_them(key: str) -> None:
    pytest.importorskip("peft")
    try:
        config = config_from_dict({"r": 4, "lora_alpha": 8, "alpha_pattern": {key: 64}}, name="a")
    except AdapterFormatError:
        assert key == "(a)\\3"  # PEFT cannot compile it either ("invalid group reference")
        return
    assert {m: config.alpha_for(m) for m in MODULES} == {m: _peft_alpha(key, m, 64.0, 8.0) for m in MODULES}


def test_an_adapter_name_holding_a_lone_surrogate_is_refused_naming_it() -> None:
    with pytest.raises(AdapterSourceError) as info:
        check_adapter_name("mine\ud800x")
    assert info.value.part == "name"
    message = str(info.value)
    assert "U+D800" in message and "e.g. 'mine_x'" in message, message
    message.encode("utf-8")  # the message itself can be sent
    check_adapter_name("style-名前")  # whole characters of any script pass


def test_a_residency_label_holding_a_lone_surrogate_never_breaks_the_metrics_page(fresh_metrics: str) -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    from vllm_lora_ext import resident_metric

    resident_metric.write_resident({"mine\ud800": "gpu", "style": "cpu"}, max_series=8)
    registry: Any = CollectorRegistry()
    MultiProcessCollector(registry, path=fresh_metrics)
    text = generate_latest(registry).decode()  # raised UnicodeEncodeError: every scrape of /metrics was a 500
    assert 'adapter_name="style"' in text and "mine\\\\ud800" in text, text
    resident_metric.clear_resident()


@pytest.mark.parametrize(("field", "value", "fragment"), [
    ("alora_invocation_tokens", [32, 4], "Activated LoRA"),
    ("layer_replication", [[0, 2], [1, 2]], "layer_replication"),
    ("use_qalora", True, "QALoRA"),
    ("use_bdlora", {"nblocks": 2}, "block-diagonal LoRA"),
])
def test_peft_features_that_change_what_the_factors_mean_are_refused(field: str, value: Any, fragment: str) -> None:
    """vLLM 0.33's PEFTHelper refuses these; vLLM 0.26's does not, and the plugin's own feature check let them through,
    so on 0.26 an aLoRA (its factors shaped as any LoRA's) was served on every token as a plain LoRA (r45)."""
    with pytest.raises(AdapterFormatError, match="cannot be served") as info:
        config_from_dict({"r": 4, "lora_alpha": 8, field: value}, name="a")
    assert fragment in str(info.value)
    config_from_dict({"r": 4, "lora_alpha": 8, field: None}, name="a")  # unset (PEFT writes null): a plain LoRA


def test_checking_pattern_keys_on_many_threads_leaves_the_warning_filters_alone_and_refuses_after_re_cached_them(
) -> None:
    """(Review of r45.) The check once turned re's FutureWarning into an error inside ``warnings.catch_warnings``,
    which is process state: threads checking configs at once left the 'error' filter installed (any later
    FutureWarning in the process raised) or dropped it during a check (a bad key passed). And ``re`` warns only the
    first time it compiles a pattern, so after PEFT (or anything) had compiled ``(.*\\.)?([[:alpha:]]_proj)$``, the
    key passed. The check is now a scan of the key's text."""
    import re
    import sys
    import threading
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        re.compile(r"(.*\.)?([[:alpha:]]_proj)$")  # as PEFT compiles it: re caches it, and warns no more
    with pytest.raises(AdapterFormatError, match="read differently"):
        config_from_dict({"r": 8, "lora_alpha": 16, "alpha_pattern": {"[[:alpha:]]_proj": 64}})
    before = list(warnings.filters)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        def check(n: int) -> None:
            for j in range(40):
                config_from_dict({"r": 8, "lora_alpha": 16, "alpha_pattern": {f"layers\\.{n}{j}\\.q_proj": 32}})

        threads = [threading.Thread(target=check, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert warnings.filters == before


@pytest.mark.parametrize("key", ["q_proj\\{x\\}", "[{]_proj", "[a-z]{2}_proj", "[]]x"])
def test_braces_and_sets_both_engines_read_alike_are_accepted_as_peft_accepts_them(key: str) -> None:
    config_from_dict({"r": 8, "lora_alpha": 16, "alpha_pattern": {key: 32}})
