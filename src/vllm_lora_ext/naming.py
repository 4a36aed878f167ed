"""Adapter names and the mix grammar: which names an adapter may take, and what a ``model`` field asks for.

The mix grammar (`vllm_lora_ext.mixing`) reads ``a=0.7+b=0.3`` as a mix, and the server names each mix
it makes ``mix-<label>-<digest prefix>`` ([`MixSpec.lora_name`]). So the whole grammar is reserved:

- no adapter name, on any route that registers one (``--lora-modules``, ``/v1/load_lora_adapter``, a
  deployment config, a Ray multiplexed id), may hold ``+`` or ``=`` (`RESERVED_NAME_CHARS`) or start
  with ``mix-`` ([`check_adapter_name`]); otherwise a client could register an adapter under a mix's
  spelling and be served to every client asking for that mix;
- no client or config may name a source that starts with a prefix only the server writes into a ``lora_path``:
  ``mix:`` (a mix's spec) or the build-ahead probe's (`SERVER_ONLY_PREFIXES`, [`server_only_prefix`]);
- a served base-model name may hold them (``acme/llama+sft``, ``llama-ckpt=step5000``): the server matches
  served names before any mix parsing;
- a ``model`` naming a mix the server made and later evicted names that mix again, when its label spells
  the mix out and the mix it spells has this very name ([`mix_in_model`]); else it is a 404 naming the fix;
- the body fields ``adapters`` (names) and ``adapter_weights`` (numbers) are checked for type and the one
  weight rule before any name is looked up ([`check_mix_fields`]).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import cast

from vllm_lora_ext._util import clip, short_repr
from vllm_lora_ext.constants import MIX_NAME_PREFIX, MIX_PREFIX, PREBUILD_PREFIX
from vllm_lora_ext.errors import AdapterNotFoundError, AdapterSourceError, MixError
from vllm_lora_ext.mixing import check_weight, parse_mix_expression, resolve_mix

__all__ = ["MIX_BODY_FIELDS", "RESERVED_NAME_CHARS", "SERVER_ONLY_PREFIXES", "check_adapter_name", "check_mix_fields",
           "check_not_base_model",
           "mix_body_fields",
           "mix_name_expression", "mix_in_model", "reserved_part", "server_only_prefix"]

# The characters of the mix grammar: an adapter name holding one would be read as a mix.
RESERVED_NAME_CHARS = ("+", "=")
# Prefixes of a lora_path that only the server writes: a mix's spec and a build-ahead probe.
SERVER_ONLY_PREFIXES = (MIX_PREFIX, PREBUILD_PREFIX)
_MIX_NAME = re.compile(r"mix-(.+)-([0-9a-f]{24})", re.DOTALL)


def reserved_part(name: str) -> str | None:
    """Say what part of ``name`` the mix grammar reserves (``None``: nothing): the one rule of this module.

    A ``model`` for which this is not ``None`` is read as a mix (unless it is a served or registered name),
    and no adapter may be registered under such a name.

    Example:
        >>> reserved_part("style=0.7+domain"), reserved_part("mix-a"), reserved_part("acme/style-v2")
        ("contains '+' and '='", "starts with 'mix-'", None)
    """
    held = [c for c in RESERVED_NAME_CHARS if c in name]
    if name.startswith(MIX_NAME_PREFIX):
        return f"starts with {MIX_NAME_PREFIX!r}" + (" and contains " + " and ".join(map(repr, held)) if held else "")
    return "contains " + " and ".join(map(repr, held)) if held else None


def server_only_prefix(path: object) -> str | None:
    """Return the prefix of ``path`` that only the server writes (``None``: none, or not a string).

    Example:
        >>> server_only_prefix("mix:a=1"), server_only_prefix("hf:acme/sql"), server_only_prefix(None)
        ('mix:', None, None)
    """
    return next((p for p in SERVER_ONLY_PREFIXES if path.startswith(p)), None) if isinstance(path, str) else None


def check_adapter_name(name: object) -> None:
    """Refuse an adapter name that the mix grammar reserves: one holding ``+`` or ``=``, starting with ``mix-``, or
    starting or ending with whitespace (Unicode spaces included: the grammar trims them).

    The one name rule of every route that registers an adapter. A non-string passes (the route's own
    type checks answer it).

    Raises:
        [`AdapterSourceError`]: the name is reserved (``part="name"``); the message names the reserved
            characters or prefix and a name to use instead.

    Example:
        >>> check_adapter_name("style-v2")
        >>> check_adapter_name("style=0.7+domain=0.3")
        Traceback (most recent call last):
        ...
        vllm_lora_ext.errors.AdapterSourceError: Adapter name 'style=0.7+domain=0.3' contains '+' and '=', which the mix grammar reserves ('a=0.7+b=0.3' asks for a mix), so requests naming it would be read as a mix. Choose a name without '+' or '=' or the prefix 'mix-', e.g. 'style-0.7_domain-0.3'.
    """
    if isinstance(name, str) and not _utf8(name):  # a lone surrogate ("\\ud800" in a JSON body): vLLM's engine
        # client cannot send the name to the engine (msgpack: "surrogates not allowed"), and /metrics, whose residency
        # gauge labels adapters by name, could not encode its page
        raise AdapterSourceError(
            f"Adapter name {short_repr(name)} holds a lone UTF-16 surrogate ({_first_surrogate(name)}), which is no "
            f"character and cannot be encoded as UTF-8. Choose a name of whole characters, e.g. "
            f"{short_repr(name.encode('utf-8', 'replace').decode().replace('?', '_') or 'adapter')}.",
            source=clip(name.encode("utf-8", "backslashreplace").decode()), part="name")
    if isinstance(name, str) and name != name.strip():  # the mix syntax in 'model' trims each name (spaces around
        # '=' and '+' are allowed): ' style' there would name 'style', another adapter, so it may not be registered
        raise AdapterSourceError(
            f"Adapter name {short_repr(name)} starts or ends with whitespace, which a mix written in 'model' trims "
            f"('{name.strip()}=0.5+...' would name another adapter). Choose a name without it, e.g. "
            f"{short_repr(name.strip() or 'adapter')}.", source=clip(name), part="name")
    part = reserved_part(name) if isinstance(name, str) else None
    if part is None:
        return
    fix = name.replace("+", "_").replace("=", "-")
    while fix.startswith(MIX_NAME_PREFIX):
        fix = fix[len(MIX_NAME_PREFIX):]
    hint = f", e.g. {short_repr(fix)}" if fix else ""
    why = ("which is reserved for the server's weighted mixes" if name.startswith(MIX_NAME_PREFIX) else
           "which the mix grammar reserves ('a=0.7+b=0.3' asks for a mix), so requests naming it would be read "
           "as a mix")
    raise AdapterSourceError(f"Adapter name {short_repr(name)} {part}, {why}. Choose a name without '+' or '=' or the "
                             f"prefix {MIX_NAME_PREFIX!r}{hint}.", source=clip(name), part="name")


def check_not_base_model(name: object, is_base_model: Callable[[str], bool]) -> None:
    """Refuse an adapter name that is a served base model's name (``is_base_model``: vLLM's, any served alias).

    vLLM 0.33 refuses it on its load route; 0.26 does not, and its adapter lookup (``_maybe_get_adapters``) looks in
    the loaded adapters before the base model: every request naming the base model would be served the adapter.

    Raises:
        [`AdapterSourceError`]: ``part="name"``; the message says why and to choose another name.
    """
    if isinstance(name, str) and is_base_model(name):
        raise AdapterSourceError(f"Adapter name {short_repr(name)} is the name of a served base model: requests "
                                 f"naming the base model would be served this adapter. Give the adapter another "
                                 f"name.", source=clip(name), part="name")


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _first_surrogate(text: str) -> str:
    at = next(i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)
    return f"U+{ord(text[at]):04X} at character {at}"


def mix_name_expression(name: str) -> str | None:
    """Return the mix a server-made mix name spells out, or ``None`` if it spells none out whole.

    Example:
        >>> mix_name_expression("mix-style=0.7+domain=0.3-0123456789abcdef01234567")
        'style=0.7+domain=0.3'
        >>> mix_name_expression("mix-" + "a" * 77 + "...-0123456789abcdef01234567") is None
        True
    """
    m = _MIX_NAME.fullmatch(name) if isinstance(name, str) else None
    if m is None or m.group(1).endswith("..."):
        return None
    return m.group(1)


def mix_in_model(model: str, *, sources: Mapping[str, str], default_weights: Mapping[str, float]
                 ) -> tuple[list[str], list[float] | None]:
    """Return the adapters and weights (``None``: defaults) of the mix a ``model`` field writes out.

    ``model`` is a mix in the grammar (``a=0.7+b=0.3``), or the name the server gave a mix
    (``mix-a=0.7+b=0.3-<digest>``, e.g. read from an earlier response) that is no longer registered.
    Such a name is made again only if its label spells a mix out and that mix, resolved against the
    adapters registered now, has this very name (its digest covers the pinned sources and exact weights).

    Raises:
        [`AdapterNotFoundError`]: a ``mix-`` name that cannot be made again (its label was cut short, or
            the adapters registered now give another mix); the message says to ask by the adapters.
        [`MixError`]: a malformed mix (quoting the part that is wrong).

    Example:
        >>> mix_in_model("a=0.7+b", sources={"a": "/a", "b": "/b"}, default_weights={"b": 0.2})
        (['a', 'b'], [0.7, 0.2])
    """
    made = model.startswith(MIX_NAME_PREFIX)
    expr = mix_name_expression(model) if made else model
    try:
        parsed = parse_mix_expression(expr) if expr is not None else None
        if parsed is not None:
            adapters = [n for n, _ in parsed]
            weights = ([default_weights.get(n, 1.0) if w is None else w for n, w in parsed]
                       if any(w is not None for _, w in parsed) else None)
            if not made:
                return adapters, weights
            spec = resolve_mix(adapters, weights, sources=sources, default_weights=default_weights)
            if spec is not None and spec.lora_name == model:
                return adapters, weights
    except MixError:
        if not made:
            raise
    raise AdapterNotFoundError(
        f"Mix {short_repr(model)} is not registered on this server: unused mixes are evicted, and this name cannot "
        f"be made again from the adapters registered now. Ask for the mix by its adapters instead: "
        f"model='a=0.7+b=0.3', or the body fields 'adapters' and 'adapter_weights'.", source=clip(model))


def check_mix_fields(adapters: object, weights: object) -> tuple[list[str] | None, list[float] | None]:
    """Return a request's ``adapters`` and ``adapter_weights`` body fields, checked (weights made canonical).

    Raises:
        [`MixError`]: ``adapters`` is not a list of strings, ``adapter_weights`` not a list, or a weight breaks
            the one weight rule (the message quotes the weight as given and names its adapter, or ``#i``).

    An empty list is no list (``None``): a client library that sends unset list fields as ``[]`` names no mix in the
    body, and the request is routed by its ``model`` (README, Weighted mixes, rule 1).

    Example:
        >>> check_mix_fields(["a", "b"], [0.5, -0.0])
        (['a', 'b'], [0.5, 0.0])
        >>> check_mix_fields([], [])
        (None, None)
    """
    if adapters is not None and (not isinstance(adapters, list) or not all(isinstance(a, str) for a in adapters)):
        raise MixError(f"'adapters' must be a list of adapter names, got {short_repr(adapters)}.")
    names = cast("list[str] | None", adapters) or None
    if weights is None or weights == []:
        return names, None
    if not isinstance(weights, list):
        raise MixError(f"'adapter_weights' must be a list of numbers, got {short_repr(weights)}.")
    shown = names if names is not None and len(names) == len(weights) else [f"#{i}" for i in range(len(weights))]
    return names, [check_weight(w, name=n) for n, w in zip(shown, weights)]


MIX_BODY_FIELDS = ("adapters", "adapter_weights")  # a request's mix, in its body (rule 1 of README's "Weighted mixes")


def mix_body_fields(body: object) -> list[str]:
    """The mix body fields a request body sets at its top level (not null, not an empty list). ``body`` is the JSON
    body as the route parsed it (for a route whose request type drops the fields), or the request's own fields.

    Example:
        >>> mix_body_fields({"model": "m", "adapters": ["a", "b"], "adapter_weights": None})
        ['adapters']
        >>> mix_body_fields({"model": "a=0.7+b=0.3", "adapters": []}), mix_body_fields([1]), mix_body_fields(None)
        ([], [], [])
    """
    return [f for f in MIX_BODY_FIELDS if isinstance(body, Mapping) and body.get(f) not in (None, [])]
