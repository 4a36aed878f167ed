"""The spans a build's GPU image holds (``transport.prestage.Spans``): merged as they arrive, in any order."""

from __future__ import annotations

import random

from vllm_lora_ext.transport.prestage import Spans


def test_spans_merge_in_any_order_and_cover_only_what_was_added() -> None:
    rng = random.Random(0)
    for _ in range(200):
        pieces = [(s, s + rng.randint(0, 9)) for s in rng.sample(range(0, 200, 3), 25)]
        spans, held = Spans(), set()
        for s, e in pieces:
            spans.add(s, e)
            held.update(range(s, e))
        items = spans.items()
        assert items == sorted(items) and all(e1 < s2 for (_, e1), (s2, _) in zip(items, items[1:]))  # merged
        assert spans.total == len(held)
        for _ in range(50):
            s = rng.randint(0, 210)
            e = s + rng.randint(0, 12)
            assert spans.covers(s, e) == all(x in held for x in range(s, e))


def test_adjacent_spans_join_and_an_empty_span_adds_nothing() -> None:
    spans = Spans()
    spans.add(10, 20)
    spans.add(0, 10)
    spans.add(20, 30)
    spans.add(50, 50)
    assert spans.items() == [(0, 30)] and spans.covers(0, 30) and not spans.covers(29, 31)
