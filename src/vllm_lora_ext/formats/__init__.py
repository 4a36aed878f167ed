"""Adapter layouts, detected from keys *and* shapes.

Key grammar after the optional ``base_model.model.`` prefix (PEFT):

- dense: ``<module>.lora_A.weight`` ``(r, in)`` and ``<module>.lora_B.weight`` ``(out, r)``;
  embeddings ``<module>.lora_embedding_A`` ``(r, vocab)`` / ``lora_embedding_B`` ``(dim, r)``.
- MoE per-expert (2D): ``<prefix>.experts.<e>.<proj>.lora_{A,B}.weight``, one pair per expert.
- MoE fused (3D, PEFT ``target_parameters``): ``<prefix>.experts[.base_layer]*.lora_{A,B}.weight``,
  A ``(r·E, in)`` expert-major, B ``(out, r·E)`` expert-minor.
"""

from __future__ import annotations

import itertools
import re
from functools import lru_cache
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

__all__ = ["KeyInfo", "Layout", "classify_key", "detect_layout", "expert_key_rows", "expert_key_splits",
           "group_moe_keys", "strip_peft_prefix"]

Layout = Literal["dense", "moe_2d", "moe_3d", "moe_mixed", "empty"]
KeyKind = Literal["dense", "moe_2d", "moe_3d", "other"]

PEFT_PREFIX = "base_model.model."
_PEFT_LEN = len(PEFT_PREFIX)
_LORA_SUFFIX = re.compile(r"\.(lora_A|lora_B)\.weight$|\.(lora_embedding_A|lora_embedding_B)$")
_EXPERT_2D = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>[^.]+)$")
_EXPERT_3D = re.compile(r"^(?P<prefix>.*\.experts)(?P<nest>(\.base_layer)*)$")
# One line of "\n".join(keys): a plain per-expert key, or (second branch, all groups empty) any other line. The
# atomic group takes the PEFT prefix whenever it is there, as classify_key strips it whenever it is there.
_EXPERT_LINES = re.compile(r"^(?>(base_model\.model\.)?)(.*\.experts)\.([0-9]+)\.([^.\n]+)\.lora_([AB])\.weight$|^.*$",
                           re.MULTILINE)

# The same lines split around the expert number: ``(head, tail)``, the head up to ".experts." (with the PEFT
# prefix, taken as above) and the tail from the dot after the number; ``("", "")`` for any other line.
_EXPERT_SPLITS = re.compile(r"^((?>(?:base_model\.model\.)?).*\.experts\.)[0-9]+(\.[^.\n]+\.lora_[AB]\.weight)$|^.*$",
                            re.MULTILINE)

ExpertRow = tuple[str, str, str, str, str]
"""``(peft_prefix, experts_prefix, expert, proj, which)`` of a per-expert key; ``experts_prefix`` is empty for others."""


class KeyInfo(NamedTuple):
    """What one checkpoint key is (a tuple: one is made per key, 37k for an MoE adapter).

    Attributes:
        key: the key as stored.
        module: the module path without the PEFT prefix and the ``lora_*`` suffix.
        which: ``"A"`` or ``"B"`` (embeddings too).
        kind: dense, moe_2d, moe_3d, or other (not a LoRA weight).
        experts_prefix: ``...experts`` for MoE keys.
        expert: the expert index for 2D keys.
        proj: the projection name for 2D keys (``gate_proj``, ``w1``, ...).
        nesting: the number of ``.base_layer`` levels for 3D keys.
    """

    key: str
    module: str
    which: Literal["A", "B", ""]
    kind: KeyKind
    experts_prefix: str | None = None
    expert: int | None = None
    proj: str | None = None
    nesting: int = 0


def strip_peft_prefix(key: str) -> str:
    """Remove PEFT's ``base_model.model.`` prefix if present."""
    return key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key


@lru_cache(maxsize=262144)
def classify_key(key: str) -> KeyInfo:
    """Classify one checkpoint key by its name (shapes are checked later against the model).

    Example:
        >>> classify_key("base_model.model.model.layers.0.mlp.experts.7.up_proj.lora_B.weight").expert
        7
    """
    if "\n" in key:  # the regexes' "." and "$" treat newlines specially: keep their exact reading
        return _classify_by_regex(key)
    bare = key[_PEFT_LEN:] if key.startswith(PEFT_PREFIX) else key
    if bare.endswith(".lora_A.weight"):
        which: Literal["A", "B"] = "A"
        module = bare[:-14]
    elif bare.endswith(".lora_B.weight"):
        which = "B"
        module = bare[:-14]
    else:
        m = _LORA_SUFFIX.search(bare)
        if not m:
            return KeyInfo(key, bare, "", "other")
        tag = m.group(1) or m.group(2)
        which = "A" if tag.endswith("A") else "B"
        module = bare[: m.start()]
    # per-expert: "<...>.experts.<digits>.<proj>" (proj without dots)
    head, _, proj = module.rpartition(".")
    prefix, _, expert = head.rpartition(".")
    if proj and expert.isdecimal() and prefix.endswith(".experts"):
        return KeyInfo(key, module, which, "moe_2d", prefix, int(expert), proj)
    if ".experts" in module:
        m3 = _EXPERT_3D.match(module)
        if m3:
            return KeyInfo(key, module, which, "moe_3d", m3["prefix"], nesting=m3["nest"].count(".base_layer"))
    return KeyInfo(key, module, which, "dense")


def expert_key_rows(keys: Sequence[str]) -> list[ExpertRow] | None:
    """Read every plain per-expert (2D) key of ``keys`` in one regex pass, without a Python call per key.

    An MoE adapter has tens of thousands of keys, nearly all ``<prefix>.experts.<e>.<proj>.lora_{A,B}.weight``.
    Returns one row per key, in order: ``(peft_prefix, experts_prefix, expert, proj, which)``, with
    ``expert`` in ASCII digits. A row with an empty ``experts_prefix`` is a key this pass does not read
    (dense, 3D, embedding-named or non-ASCII-digit per-expert keys): ask [`classify_key`] about those. Where a
    row is read, it says exactly what [`classify_key`] says (``module`` is ``experts_prefix.expert.proj``).
    Returns ``None`` if a key holds a newline (then classify each key).

    Example:
        >>> expert_key_rows(["base_model.model.m.layers.0.mlp.experts.7.up_proj.lora_B.weight", "m.q.lora_A.weight"])
        [('base_model.model.', 'm.layers.0.mlp.experts', '7', 'up_proj', 'B'), ('', '', '', '', '')]
    """
    return _line_matches(_EXPERT_LINES, keys)


def expert_key_splits(keys: Sequence[str]) -> list[tuple[str, str]] | None:
    """Split every plain per-expert (2D) key of ``keys`` around its expert number, in one regex pass (for many keys:
    by spelling the patterns a sample of them shows, `_spelled_splits`, and the regex pass for what it leaves).

    Returns one ``(head, tail)`` per key, in order: the key is ``head + expert + tail``, where [`expert_key_rows`]
    reads ``(peft_prefix, experts_prefix, expert, proj, which)``, ``head`` is ``peft_prefix + experts_prefix +
    "."`` and ``tail`` is ``"." + proj + ".lora_" + which + ".weight"``; ``("", "")`` where it reads no row. Two
    keys with the same pair differ in the expert number only. Returns ``None`` if a key holds a newline.

    Example:
        >>> expert_key_splits(["base_model.model.m.layers.0.mlp.experts.7.up_proj.lora_B.weight", "m.q.lora_A.weight"])
        [('base_model.model.m.layers.0.mlp.experts.', '.up_proj.lora_B.weight'), ('', '')]
    """
    found = _spelled_splits(keys)
    if found is None:
        return _line_matches(_EXPERT_SPLITS, keys)
    if not all(found):  # keys the spelling did not give (other keys, other experts): split by the regex pass
        missing = [i for i, split in enumerate(found) if split is None]
        rest = _line_matches(_EXPERT_SPLITS, [keys[i] for i in missing])
        if rest is None:
            return None
        for i, split in zip(missing, rest):
            found[i] = split
    return found


def _spelled_splits(keys: Sequence[str]) -> list[tuple[str, str] | None] | None:
    """Each key's `expert_key_splits` pair found by spelling instead of reading: the heads and tails of a sample
    of the keys (read by the regex pass), joined around every expert number up to the largest the sample and the
    key count suggest, and each key looked up among them (``None`` where not found); ``None`` for few keys.

    A spelled key splits by the regex pass exactly as it was spelled (the head's match ends at its
    ``.experts.``, the only one the number and the tail can follow), so a key found is split as the regex pass
    splits it, whatever the sample missed: what it missed is only found by that pass instead.
    """
    n = len(keys)
    if n < 1024:
        return None
    sample = [*keys[:256], *keys[256::61]]  # (tails: the first keys, adjacent; heads: across the file)
    rows = _line_matches(_EXPERT_SPLITS, sample)
    if rows is None:
        return None
    read = [(key, row) for key, row in zip(sample, rows) if row[0]]
    heads = dict.fromkeys(row[0] for _, row in read)
    tails = dict.fromkeys(row[1] for _, row in read)
    patterns = len(heads) * len(tails)
    numbers = [key[len(row[0]):len(key) - len(row[1])] for key, row in read]
    count = max([n // patterns if read else 0, *(int(e) + 1 for e in numbers if len(e) < 7)])
    if not read or patterns * count > 2 * n:  # (no per-expert key read; or more spelled than twice the keys)
        return None
    if patterns * count == n:  # (as many keys as the patterns spell: maybe in name order, as safetensors writes them)
        in_order = _splits_in_name_order(keys, sorted(heads), sorted(tails), count)
        if in_order is not None:
            return in_order  # type: ignore[return-value]
    experts = list(map(str, range(count)))
    spelled: dict[str, tuple[str, str]] = {}
    for head in heads:
        numbered = list(map(str.__add__, itertools.repeat(head), experts))
        for tail in tails:
            spelled.update(zip(map(str.__add__, numbered, itertools.repeat(tail)), itertools.repeat((head, tail))))
    return list(map(spelled.get, keys))


def _splits_in_name_order(keys: Sequence[str], heads: list[str], tails: list[str],
                          count: int) -> list[tuple[str, str]] | None:
    """Each key's split where ``keys`` are exactly the ``heads`` (sorted) joined to experts ``0..count-1`` and the
    ``tails`` (sorted) in the order of their names, found by one comparison of texts; ``None`` where they are not.

    The keys sort by head, then expert number as text (a dot follows the number, and sorts before every digit), then
    tail ([`spelled_in_name_order`]).
    """
    if not spelled_in_name_order(keys, heads, count, tails):
        return None
    rows = [[(head, tail) for tail in tails] for head in heads]  # each head's splits, one expert's keys
    return list(itertools.chain.from_iterable(itertools.chain.from_iterable(map(itertools.repeat, rows,
                                                                                   itertools.repeat(count)))))


def spelled_in_name_order(keys: Sequence[str], heads: Sequence[str], count: int, tails: Sequence[str]) -> bool:
    """Whether ``keys`` are exactly each of ``heads`` joined to the expert numbers ``0..count-1`` in the order of
    their names (as text: ``0, 1, 10, 100, ...``) and each of those to every one of ``tails``, in that order; found
    by one comparison of texts instead of a lookup per key.

    Each head and number joins the tails into its lines ("" + p + t1 + "\\n" + p + t2 ...); with as many lines and
    no newline in a head or tail, equal texts are equal keys.
    """
    if not heads or not tails or len(keys) != len(heads) * count * len(tails):
        return False
    if any("\n" in part for part in (*heads, *tails)):
        return False
    numbers = list(map(str, sorted(range(count), key=str)))
    lines = ["", *(f"{tail}\n" for tail in tails[:-1]), tails[-1]]
    spelled = map(str.join, [head + number for head in heads for number in numbers], itertools.repeat(lines))
    return "\n".join(keys) == "\n".join(spelled)


def _line_matches(pattern: re.Pattern[str], keys: Sequence[str]) -> list[Any] | None:
    """``pattern``'s groups for each key, in one pass over the keys joined by newlines (``pattern`` matches every
    line, multiline); ``None`` if a key holds a newline."""
    if not keys:
        return []
    joined = "\n".join(keys)
    if joined.count("\n") != len(keys) - 1:
        return None
    found = pattern.findall(joined)
    return found if len(found) == len(keys) else None


def _classify_by_regex(key: str) -> KeyInfo:
    """The reference reading of the key grammar (used for keys with newlines, and by the tests)."""
    bare = strip_peft_prefix(key)
    m = _LORA_SUFFIX.search(bare)
    if not m:
        return KeyInfo(key, bare, "", "other")
    tag = m.group(1) or m.group(2)
    which: Literal["A", "B"] = "A" if tag.endswith("A") else "B"
    module = bare[: m.start()]
    m2 = _EXPERT_2D.match(module)
    if m2:
        return KeyInfo(key, module, which, "moe_2d", m2["prefix"], int(m2["expert"]), m2["proj"])
    m3 = _EXPERT_3D.match(module)
    if m3:
        return KeyInfo(key, module, which, "moe_3d", m3["prefix"], nesting=m3["nest"].count(".base_layer"))
    return KeyInfo(key, module, which, "dense")


def detect_layout(keys: Iterable[str]) -> Layout:
    """Return the adapter's overall layout from its keys."""
    kinds = {classify_key(k).kind for k in keys} - {"other"}
    moe = kinds & {"moe_2d", "moe_3d"}
    if not kinds:
        return "empty"
    if moe == {"moe_2d", "moe_3d"}:
        return "moe_mixed"
    if moe:
        return "moe_2d" if "moe_2d" in moe else "moe_3d"
    return "dense"


def group_modules(keys: Iterable[str]) -> dict[str, dict[str, str]]:
    """Group LoRA keys by module: ``{module: {"A": key, "B": key}}`` in first-seen order."""
    out: dict[str, dict[str, str]] = {}
    for k in keys:
        info = classify_key(k)
        if info.kind == "other":
            continue
        out.setdefault(info.module, {})[info.which] = k
    return out


def group_moe_keys(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, dict[str, tuple[int, ...]]]:
    """Return ``{experts_prefix: {key: shape}}`` for every MoE key (2D or 3D), in file order."""
    keys = list(shapes)
    rows = expert_key_rows(keys)
    out: dict[str, dict[str, tuple[int, ...]]] = {}
    for k, row in zip(keys, rows if rows is not None else itertools.repeat(_NO_ROW)):
        prefix = row[1]
        if not prefix:
            if ".experts" not in k:  # an MoE key's module always holds ".experts"
                continue
            info = classify_key(k)
            if info.kind not in ("moe_2d", "moe_3d") or not info.experts_prefix:
                continue
            prefix = info.experts_prefix
        out.setdefault(prefix, {})[k] = shapes[k]
    return out


_NO_ROW: ExpertRow = ("", "", "", "", "")


def layout_by_layer(keys: Iterable[str]) -> Mapping[str, str]:
    """Return ``{experts_prefix: "2d"|"3d"|"2d+3d"}`` for every MoE block that has keys."""
    seen: dict[str, set[str]] = {}
    for k in keys:
        info = classify_key(k)
        if info.kind in ("moe_2d", "moe_3d") and info.experts_prefix:
            seen.setdefault(info.experts_prefix, set()).add(info.kind[-2:])
    return {p: "+".join(sorted(v)) for p, v in seen.items()}
