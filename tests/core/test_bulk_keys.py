"""Bulk key reading: one regex pass and set checks in place of a Python call per key, saying exactly what the
key-by-key path says (issue 12 P2: an MoE adapter's fixed per-key cost)."""

from __future__ import annotations

import itertools
import random

import pytest

from vllm_lora_ext.config import config_from_dict
from vllm_lora_ext.errors import ExpertLayoutError
from vllm_lora_ext.formats import (_classify_by_regex, classify_key, expert_key_rows, expert_key_splits,
                                   group_moe_keys)
from vllm_lora_ext.formats.moe import MoESpec
from vllm_lora_ext.formats.moe_plan import _plan_complete_2d, plan_experts

P = "base_model.model."
BLOCK = "model.layers.3.mlp.experts"
SPEC = MoESpec(BLOCK, 4, 16, 6)


def _corpus() -> list[str]:
    """Keys of every shape the grammar knows, and the near misses a hostile or odd file may hold."""
    heads = ["", P, P + P, "base_model.model", "x."]
    prefixes = ["model.layers.0.mlp.experts", "experts", ".experts", "a.experts.b", "m.experts", "m.Experts",
                "m.experts.base_layer", "m.shared_experts", "a..experts", "m.experts\r"]
    experts = ["0", "7", "12345", "007", "", "٣", "1a", "-1", " 1"]
    projs = ["gate_proj", "w1", "up.proj", "", "x y", "lora_A"]
    suffixes = [".lora_A.weight", ".lora_B.weight", ".lora_embedding_A", ".lora_B", ".weight", ".lora_C.weight",
                ".lora_A.weight.x"]
    keys = [f"{h}{p}.{e}.{j}{s}" for h, p, e, j, s in itertools.product(heads, prefixes, experts, projs, suffixes)]
    keys += [f"{h}{p}{s}" for h, p, s in itertools.product(heads, prefixes, suffixes)]  # 3D and dense forms
    keys += ["", ".", "lora_A.weight", f"{P}model.layers.0.self_attn.q_proj.lora_A.weight", f"{P}experts.1.p.lora_A.weight"]
    return keys


def test_each_row_the_bulk_pass_reads_says_what_classify_key_says() -> None:
    keys = _corpus()
    random.Random(0).shuffle(keys)
    rows = expert_key_rows(keys)
    assert rows is not None and len(rows) == len(keys)
    read = 0
    for key, (head, prefix, expert, proj, which) in zip(keys, rows):
        info = classify_key(key)
        assert info == _classify_by_regex(key)  # the key-by-key reading itself agrees with the grammar's regexes
        if not prefix:
            assert (head, expert, proj, which) == ("", "", "", "")
            continue
        read += 1
        assert info.kind == "moe_2d" and info.experts_prefix == prefix and info.expert == int(expert)
        assert (info.proj, info.which, info.module) == (proj, which, f"{prefix}.{expert}.{proj}")
        assert key == f"{head}{prefix}.{expert}.{proj}.lora_{which}.weight" and head in ("", P)
    assert read > 500  # the corpus exercises the read branch, not only the misses
    # the keys it leaves to classify_key include per-expert ones (non-ASCII digits, embedding names)
    assert any(classify_key(k).kind == "moe_2d" for k, r in zip(keys, rows) if not r[1])


def test_each_split_the_bulk_pass_makes_is_the_row_it_reads_around_the_expert_number() -> None:
    keys = _corpus()
    random.Random(2).shuffle(keys)
    rows, splits = expert_key_rows(keys), expert_key_splits(keys)
    assert rows is not None and splits is not None and len(splits) == len(keys)
    for key, (peft, prefix, expert, proj, which), split in zip(keys, rows, splits):
        if not prefix:
            assert split == ("", "")
            continue
        assert split == (f"{peft}{prefix}.", f".{proj}.lora_{which}.weight") and key == split[0] + expert + split[1]
    assert sum(1 for s in splits if s[0]) > 500
    assert expert_key_splits([]) == [] and expert_key_splits(["a\nb.experts.1.p.lora_A.weight"]) is None


@pytest.mark.parametrize("seed", range(6))
def test_splits_found_by_spelling_the_sampled_patterns_are_the_regex_passes(seed: int) -> None:
    """A large adapter's keys are split by spelling the patterns a sample of them shows (`_spelled_splits`): the
    same pairs as the regex pass, whatever the sample misses (odd keys, experts past the guess, a shuffle)."""
    from vllm_lora_ext.formats import _EXPERT_SPLITS, _line_matches, _spelled_splits

    rng = random.Random(seed)
    projs = ["gate_proj", "up_proj", "down_proj"] + (["experts"] if seed % 2 else [])
    keys = [f"{h}model.layers.{layer}.mlp.experts.{e}.{p}.lora_{w}.weight" for h in (P, "")[:1 + seed % 2]
            for layer in range(4) for e in range(rng.choice([48, 64])) for p in projs for w in "AB"]
    keys += rng.sample(_corpus(), 300 * (seed % 3)) + [f"{P}m.experts.{e}.x.lora_A.weight" for e in (200, 7, 0o7)]
    keys += [f"{P}m.experts.007.x.lora_A.weight", f"{P}experts.1.p.lora_A.weight", "m.experts.1.q.lora_B.weight"]
    if seed >= 3:
        rng.shuffle(keys)
    spelled = _spelled_splits(keys)
    if seed % 3 == 0:  # (many odd patterns in the sample may make it spell too much: then the regex pass alone)
        assert spelled is not None and sum(map(bool, spelled)) > len(keys) // 2  # found by spelling, most of them
    assert expert_key_splits(keys) == _line_matches(_EXPERT_SPLITS, keys)
    assert expert_key_splits([*keys, "a\nb.experts.1.p.lora_A.weight"]) is None


@pytest.mark.parametrize("change", ["", "007", "missing", "extra head", "newline"])
def test_keys_in_name_order_are_split_by_one_comparison_as_the_regex_pass_splits_them(change: str) -> None:
    """Keys in name order (as safetensors writes them) that the sampled patterns spell exactly are split by one
    comparison of texts (`_splits_in_name_order`); any near miss is split otherwise, always as the regex pass."""
    from vllm_lora_ext.formats import _EXPERT_SPLITS, _line_matches, _splits_in_name_order

    keys = sorted(f"{P}model.layers.{layer}.mlp.experts.{e}.{p}.lora_{w}.weight" for layer in range(12)
                  for e in range(20) for p in ("gate_proj", "up_proj", "down_proj") for w in "AB")
    if change == "007":
        keys[500] = keys[500].replace(".experts.", ".experts.00")
    elif change == "missing":
        keys[700] = keys[700].replace(".lora_A.", ".lora_C.")
    elif change == "extra head":
        keys[900] = keys[900].replace("model.layers", "model.layer")
    elif change == "newline":
        keys[1000] = keys[1000].replace("weight", "we\night")
    heads = sorted({k[:k.index(".experts.") + 9] for k in keys})
    tails = sorted({"." + k.split(".experts.")[1].split(".", 1)[1] for k in keys[:6]})
    in_order = _splits_in_name_order(keys, heads, tails, 20)
    assert (in_order is not None) == (change == "")
    assert expert_key_splits(keys) == _line_matches(_EXPERT_SPLITS, keys)
    if not change:
        assert in_order == expert_key_splits(keys)


def test_a_key_holding_a_newline_makes_every_key_go_key_by_key() -> None:
    keys = [f"{BLOCK}.0.up_proj.lora_A.weight", f"{BLOCK}.1.up_proj.lora_A.weight\n{BLOCK}.2.up_proj.lora_A.weight"]
    assert expert_key_rows(keys) is None
    assert expert_key_rows([]) == []
    shapes = {k: (4, 16) for k in keys}
    assert group_moe_keys(shapes) == _group_key_by_key(shapes)  # the newline key is one 2D key, as classify_key says


def _group_key_by_key(shapes: dict) -> dict:
    out: dict = {}
    for k, s in shapes.items():
        info = classify_key(k)
        if info.kind in ("moe_2d", "moe_3d") and info.experts_prefix:
            out.setdefault(info.experts_prefix, {})[k] = s
    return out


def test_grouping_moe_keys_in_bulk_equals_grouping_key_by_key() -> None:
    keys = _corpus()
    random.Random(1).shuffle(keys)
    shapes = {k: (i % 5, 3) for i, k in enumerate(keys)}
    got = group_moe_keys(shapes)
    assert got == _group_key_by_key(shapes)
    assert all(list(g) == [k for k in shapes if k in g] for g in got.values())  # file order kept


def _block(n: int = 4, *, head: str = P, projs: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj"),
           r: int = 4) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for e in range(n):
        for proj in projs:
            d_in, d_out = (6, 16) if proj in ("down_proj", "w2") else (16, 6)
            shapes[f"{head}{BLOCK}.{e}.{proj}.lora_A.weight"] = (r, d_in)
            shapes[f"{head}{BLOCK}.{e}.{proj}.lora_B.weight"] = (d_out, r)
    return shapes


def _by_key(shapes: dict, spec: MoESpec = SPEC) -> object:
    """plan_experts with its set-based path switched off: the reference, key by key."""
    import vllm_lora_ext.formats.moe_plan as moe

    fast, moe._plan_complete_2d = moe._plan_complete_2d, lambda *a: None
    try:
        return plan_experts(shapes, spec, config=config_from_dict({"r": 4}))
    except ExpertLayoutError as e:
        return str(e)
    finally:
        moe._plan_complete_2d = fast


def _same(a: object, b: object) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return (sorted(a.keys_2d), a.keys_3d, a.spec) == (sorted(b.keys_2d), b.keys_3d, b.spec)  # type: ignore[attr-defined]


@pytest.mark.parametrize("head", ["", P])
@pytest.mark.parametrize("projs", [("gate_proj", "up_proj", "down_proj"), ("down_proj",), ("gate_proj", "w3", "w2")])
def test_a_complete_per_expert_block_is_planned_by_sets_exactly_as_key_by_key(head: str, projs: tuple) -> None:
    shapes = _block(head=head, projs=projs)
    spec = SPEC if "w3" not in projs else MoESpec(BLOCK, 4, 16, 6, gate="w1", up="w3", down="w2")
    fast = _plan_complete_2d(shapes, spec)
    assert fast is not None and _same(fast, _by_key(shapes, spec))
    assert len(fast.keys_2d) == 4 * len(projs) and {k.rank for k in fast.keys_2d} == {4}


@pytest.mark.parametrize("head", ["", P])
def test_a_complete_block_in_name_order_is_found_by_one_comparison_and_planned_as_in_any_order(head: str) -> None:
    """A block written as safetensors writes it (keys by name: experts 0, 1, 10, 100, 101, ...) is recognised by
    comparing its keys with the spelled ones (`_in_name_order`); its plan is the one of the same keys in any order."""
    from vllm_lora_ext.formats.moe_plan import _in_name_order

    spec = MoESpec(BLOCK, 120, 16, 6)
    numeric = _block(120, head=head)
    by_name = dict(sorted(numeric.items()))
    shuffled = list(numeric.items())
    random.Random(3).shuffle(shuffled)
    projs = ["down_proj", "gate_proj", "up_proj"]
    assert _in_name_order(by_name, f"{head}{BLOCK}.", projs, 120) is not None
    assert _in_name_order(numeric, f"{head}{BLOCK}.", projs, 120) is None
    plans = [_plan_complete_2d(shapes, spec) for shapes in (by_name, numeric, dict(shuffled))]
    assert plans[0] is not None and plans[0].keys_2d == plans[1].keys_2d == plans[2].keys_2d  # (in one order)
    assert _same(plans[0], _by_key(by_name, spec)) and _same(plans[0], _by_key(numeric, spec))
    one = MoESpec(BLOCK, 1, 16, 6)
    assert _plan_complete_2d(dict(sorted(_block(1, head=head).items())), one) is not None


def _variants() -> dict[str, dict[str, tuple[int, ...]]]:
    full = _block()
    a0 = f"{P}{BLOCK}.0.up_proj.lora_A.weight"
    out = {
        "missing expert": {k: s for k, s in full.items() if ".2." not in k},
        "missing factor": {k: s for k, s in full.items() if k != a0},
        "expert 01 besides 1": {**full, f"{P}{BLOCK}.01.up_proj.lora_A.weight": (4, 16),
                                f"{P}{BLOCK}.01.up_proj.lora_B.weight": (6, 4)},
        "one expert without PEFT's prefix too": {**full, f"{BLOCK}.0.up_proj.lora_A.weight": (4, 16),
                                                 f"{BLOCK}.0.up_proj.lora_B.weight": (6, 4)},
        "expert out of range": {**{k: s for k, s in full.items() if ".3." not in k},
                                **{k.replace(".3.", ".4."): s for k, s in full.items() if ".3." in k}},
        "a second name for gate": {**full, **{k.replace("gate_proj", "w1"): s for k, s in full.items() if "gate" in k}},
        "one expert at another rank": {**full, a0: (8, 16), a0.replace("lora_A", "lora_B"): (6, 8)},
        "one expert of the wrong width": {**full, a0: (4, 17)},
        "ranks that disagree": {**full, a0.replace("lora_A", "lora_B"): (6, 5)},
        "a projection the model lacks": {**full, f"{P}{BLOCK}.0.x_proj.lora_A.weight": (4, 16),
                                         f"{P}{BLOCK}.0.x_proj.lora_B.weight": (6, 4)},
        "a 3D tensor too": {**full, f"{P}{BLOCK}.lora_A.weight": (16, 16), f"{P}{BLOCK}.lora_B.weight": (12, 16)},
        "a 1-D factor": {**full, a0: (4,)},
    }
    return out


@pytest.mark.parametrize("name", list(_variants()))
def test_anything_but_a_complete_block_is_left_to_the_key_by_key_plan(name: str) -> None:
    shapes = _variants()[name]
    assert _plan_complete_2d(shapes, SPEC) is None
    assert _plan_complete_2d(dict(sorted(shapes.items())), SPEC) is None  # (in name order too)
    got: object
    try:
        got = plan_experts(shapes, SPEC, config=config_from_dict({"r": 4}))
    except ExpertLayoutError as e:
        got = str(e)
    assert _same(got, _by_key(shapes))


def test_the_rank_check_names_an_a_factor_over_the_limit_and_never_a_wide_b() -> None:
    from vllm_lora_ext.errors import AdapterCompatibilityError
    from vllm_lora_ext.validation import check_ranks

    shapes = _block(r=16)
    check_ranks(shapes, [16], 16)  # every B's first dim (6, 16) is no rank
    check_ranks({**shapes, "m.lora_embedding_B": (4096, 16)}, [16], 16)
    for key in (f"{P}{BLOCK}.1.down_proj.lora_A.weight", "m.embed.lora_embedding_A"):
        with pytest.raises(AdapterCompatibilityError, match="rank 32"):
            check_ranks({**shapes, key: (32, 6)}, [16], 16)


# ------------------------------------------------------------------------------------------------ shared pools


def test_a_pool_is_lent_to_one_caller_at_a_time_kept_after_and_made_anew_in_a_forked_child() -> None:
    import os

    from vllm_lora_ext.transport.pools import lent_pool

    with lent_pool("test-pool", 2) as first:
        assert first.submit(lambda: 7).result(timeout=10) == 7
        with lent_pool("test-pool", 2) as second:  # a caller at the same time gets a pool of its own
            assert second is not first
    with lent_pool("test-pool", 2) as again:  # given back: lent again, its threads already started
        assert again in (first, second)
    pid = os.fork()
    if pid == 0:  # the parent's threads do not exist here: the child's work must still run
        ok = False
        try:
            with lent_pool("test-pool", 2) as child:
                ok = child not in (first, second) and child.submit(lambda: 7).result(timeout=10) == 7
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_failed_block_read_returns_only_once_no_block_is_running() -> None:
    import threading
    import time

    import torch

    from moe_factories import KeyByKey
    from vllm_lora_ext.formats.moe_read import ReadOptions, read_blocks

    spec = MoESpec(BLOCK, 4, 16, 6)
    plans = {f"b{i}": plan_experts(_block(), spec, config=config_from_dict({"r": 4})) for i in range(6)}
    running: list[int] = []
    seen = {"n": 0}
    lock = threading.Lock()

    def read(key: str, ranges: object) -> torch.Tensor:
        with lock:
            running.append(1)
            third = key.endswith(".1.up_proj.lora_A.weight") and (seen.__setitem__("n", seen["n"] + 1) or
                                                                  seen["n"] == 3)
        try:
            time.sleep(0.002)
            if third:  # the third block to read this key fails
                raise OSError("disk gone")
            return torch.zeros(_block()[key])
        finally:
            with lock:
                running.pop()

    with pytest.raises(OSError, match="disk gone"):
        read_blocks(plans, KeyByKey(read), config=config_from_dict({"r": 4}),
                    options=ReadOptions(workers=3, check_finite_as="x"))
    assert running == []  # every block that started has finished; none was left to run on


def test_a_complete_block_given_shapes_as_lists_is_planned_as_with_tuples() -> None:
    shapes = _block()
    as_lists = {k: list(s) for k, s in shapes.items()}
    fast = _plan_complete_2d(as_lists, SPEC)  # type: ignore[arg-type]
    assert fast is not None and _same(fast, _by_key(shapes))


def test_a_pools_threads_run_torch_ops_on_one_thread_and_the_process_keeps_its_setting() -> None:
    import torch

    from vllm_lora_ext.transport.pools import _openmp, lent_pool

    if _openmp() is None:
        pytest.skip("no OpenMP runtime found in this process")
    before = torch.get_num_threads()

    def threads_after_an_op() -> int:
        (torch.ones(1 << 20) * 2).sum()  # an op large enough to be split, were the thread's team larger
        return torch.get_num_threads()

    with lent_pool("test-omp", 2) as pool:
        assert pool.submit(threads_after_an_op).result(timeout=30) == 1
    assert torch.get_num_threads() == before  # the calling thread's (and the process's) setting is untouched
