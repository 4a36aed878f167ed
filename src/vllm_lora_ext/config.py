"""AdapterConfig: a typed, validated view of a PEFT ``adapter_config.json`` (or one inferred from tensors).

Scaling follows PEFT: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``. Per-module
``rank_pattern`` / ``alpha_pattern`` use PEFT's key rule (``get_pattern_key``): the first key, in the order
written, whose regex ``(.*\\.)?(KEY)$`` matches the module name. A key ``re`` cannot compile is refused, as
PEFT cannot load it either; a key that takes over `PATTERN_MATCH_TIMEOUT_S` to match one name (nested
repetition such as ``(a+)+c``) refuses the adapter rather than holding the process.
"""

from __future__ import annotations

import functools
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import regex

from vllm_lora_ext._util import clip, read_json_capped, short_repr
from vllm_lora_ext.constants import (MAX_CONFIG_BYTES, MAX_PATTERN_KEY_CHARS, METADATA_ALPHA_KEYS,
                                     MAX_PATTERN_KEYS, METADATA_RANK_KEYS, PATTERN_LOOKUP_CPU_S,
                                     PATTERN_MATCH_TIMEOUT_S)
from vllm_lora_ext.errors import AdapterFormatError, VllmLoraExtError

_MAX_RANK = 1 << 16
_BOOL_FIELDS = ("use_rslora", "use_dora", "lora_bias", "fan_in_fan_out", "inference_mode")

__all__ = ["AdapterConfig", "alpha_missing", "read_config", "infer_config"]


@dataclass(frozen=True)
class AdapterConfig:
    """What the loader needs from an adapter's config, checked on construction.

    Attributes:
        r: default rank.
        lora_alpha: default alpha.
        use_rslora: scale by ``alpha / sqrt(r)`` instead of ``alpha / r``.
        rank_pattern / alpha_pattern: per-module overrides (PEFT semantics).
        target_modules / target_parameters: as written (informational; layout comes from the keys).
        peft_version: the PEFT version that wrote the adapter, if recorded.
        inferred: the config was built from tensors and metadata, not read from a file.
        raw: the original mapping (passed on to vLLM's own config parser).
    """

    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    target_modules: tuple[str, ...] | str | None = None
    target_parameters: tuple[str, ...] | None = None
    peft_version: str | None = None
    base_model_name_or_path: str | None = None
    inferred: bool = False
    raw: Mapping[str, Any] = field(default_factory=dict)
    name: str = "adapter"

    def __post_init__(self) -> None:
        if not _is_rank(self.r):
            raise AdapterFormatError(f"Adapter {self.name!r}: rank r={short_repr(self.r)} must be an integer from 1 to "
                                     f"{_MAX_RANK}. Fix 'r' in its config.", adapter=self.name, key="r")
        if not _is_number(self.lora_alpha):
            raise AdapterFormatError(f"Adapter {self.name!r}: lora_alpha={short_repr(self.lora_alpha)} is not a finite "
                                     f"number. Fix 'lora_alpha'.", adapter=self.name, key="lora_alpha")
        if type(self.use_rslora) is not bool:
            raise AdapterFormatError(f"Adapter {self.name!r}: use_rslora={short_repr(self.use_rslora)} must be true or "
                                     f"false.", adapter=self.name, key="use_rslora")
        for k, v in self.rank_pattern.items():
            if not isinstance(k, str) or not _is_rank(v):
                raise AdapterFormatError(f"Adapter {self.name!r}: rank_pattern[{short_repr(k)}]={short_repr(v)} must "
                                         f"be an integer from 1 to {_MAX_RANK}.", adapter=self.name, key="rank_pattern")
        for k, alpha in self.alpha_pattern.items():
            if not isinstance(k, str) or not _is_number(alpha):
                raise AdapterFormatError(f"Adapter {self.name!r}: alpha_pattern[{short_repr(k)}]={short_repr(alpha)} must "
                                         f"be a finite number.", adapter=self.name, key="alpha_pattern")
        keys = len(self.rank_pattern) + len(self.alpha_pattern)  # (each module is matched against every key)
        if keys > MAX_PATTERN_KEYS:  # (and the compiled keys of one config stay cached together: `_matcher`)
            raise AdapterFormatError(f"Adapter {self.name!r}: rank_pattern and alpha_pattern have {keys} keys, more "
                                     f"than {MAX_PATTERN_KEYS}. Write fewer, more general patterns in "
                                     f"adapter_config.json.", adapter=self.name, key="rank_pattern")
        for field_name in ("rank_pattern", "alpha_pattern"):
            for k in getattr(self, field_name):
                _check_pattern_key(k, field_name, self.name)

    def rank_for(self, module: str) -> int:
        """Return the rank PEFT gives ``module`` (``rank_pattern`` first, else ``r``)."""
        key = _pattern_key(self.rank_pattern, module, "rank_pattern", self.name)
        return int(self.rank_pattern[key]) if key is not None else self.r

    def alpha_for(self, module: str) -> float:
        """Return the alpha PEFT gives ``module`` (``alpha_pattern`` first, else ``lora_alpha``)."""
        key = _pattern_key(self.alpha_pattern, module, "alpha_pattern", self.name)
        return float(self.alpha_pattern[key]) if key is not None else float(self.lora_alpha)

    def scaling_for(self, module: str, rank: int | None = None) -> float:
        """Return the scaling of ``module``'s delta: ``alpha/r`` or ``alpha/sqrt(r)`` (rsLoRA)."""
        r = self.rank_for(module) if rank is None else rank
        alpha = self.alpha_for(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    @property
    def has_patterns(self) -> bool:
        """Whether any per-module rank or alpha override exists."""
        return bool(self.rank_pattern) or bool(self.alpha_pattern)


def _is_rank(v: Any) -> bool:
    return type(v) is int and 1 <= v <= _MAX_RANK


def _is_number(v: Any) -> bool:
    if type(v) is int:
        return abs(v) < 1 << 1023  # a JSON integer that fits a float (10**400 would raise OverflowError)
    return type(v) is float and math.isfinite(v)


def _check_types(raw: Mapping[str, Any], name: str) -> None:
    """Raise on config values of the wrong JSON type (a bool is not an int, "false" is not a bool)."""
    problems: list[str] = []
    for key in _BOOL_FIELDS:
        if raw.get(key) is not None and type(raw[key]) is not bool:
            problems.append(f"{key}={short_repr(raw[key])} must be true or false")
    for key in ("rank_pattern", "alpha_pattern"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            problems.append(f"{key} must be an object mapping module patterns to numbers")
    tm = raw.get("target_modules")
    if tm is not None and not isinstance(tm, str) and not (isinstance(tm, list) and all(isinstance(t, str) for t in tm)):
        problems.append(f"target_modules={short_repr(tm)} must be a string or a list of strings")
    tp = raw.get("target_parameters")
    if tp is not None and not (isinstance(tp, list) and all(isinstance(t, str) for t in tp)):
        problems.append(f"target_parameters={short_repr(tp)} must be a list of strings")
    for key in ("peft_version", "base_model_name_or_path", "peft_type"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            problems.append(f"{key}={short_repr(raw[key])} must be a string")
    orient = raw.get("moe_3d_orientation")
    if orient is not None and orient not in ("standard", "transposed"):
        problems.append(f"moe_3d_orientation={short_repr(orient)} must be \"standard\" or \"transposed\"")
    if problems:
        raise AdapterFormatError(f"Adapter {name!r}: its config has values of the wrong type: " + "; ".join(problems)
                                 + ". Fix them in adapter_config.json.", adapter=name, key=None)


_REGEX_SYNTAX = frozenset("^$*+?{}[]\\|()")  # every regex metacharacter but '.'


def _check_pattern_key(key: str, field_name: str, adapter: str) -> None:
    """Refuse a pattern key PEFT's ``re.match(rf"(.*\\.)?({key})$", ...)`` cannot compile, an over-long one, and one
    the ``regex`` engine the plugin matches with (for its timeout) would read otherwise than ``re`` does
    ([`_engines_differ`]): the plugin would then give modules another rank or alpha than PEFT trained them with."""
    why = f"is {len(key)} characters, more than {MAX_PATTERN_KEY_CHARS}" if len(key) > MAX_PATTERN_KEY_CHARS else ""
    if not why:
        try:
            re.compile(rf"(.*\.)?({key})$")
            _matcher(key)
        except (re.error, regex.error, OverflowError, RecursionError, ValueError) as err:
            why = f"is not a regular expression PEFT can compile ({clip(str(err))})"
    if not why:
        why = _engines_differ(key)
    if why:
        raise AdapterFormatError(f"Adapter {adapter!r}: {field_name} key {short_repr(key)} {why}. Write the module "
                                 f"name (or a simple pattern) in adapter_config.json.", adapter=adapter, key=field_name)


_QUANTIFIER = re.compile(r"\{(?:[0-9]+|[0-9]*,[0-9]*)\}")


def _engines_differ(key: str) -> str:
    """Why ``regex`` would read ``key`` otherwise than ``re`` ('' if it reads it alike), by a scan of its text (not
    by ``re``'s FutureWarnings: warning filters are process state other threads change, and ``re`` warns only the
    first time it compiles a pattern it then caches):

    - outside a set, an unescaped ``{`` that opens no ``{m}``/``{m,n}`` repeat is a literal brace to ``re`` and, as
      in ``q_proj{e<=1}``, a fuzzy-match constraint to ``regex`` (which then matches ``k_proj`` and ``o_proj``
      too); no module name holds a brace, so such a key matches nothing in PEFT;
    - a set that starts with ``[`` (``[[:alpha:]]`` is a POSIX class to one, the characters ``[:alph`` to the other)
      or holds ``--``, ``&&``, ``~~`` or ``||`` (a set operation to one): where ``re`` itself warns."""
    i, n = 0, len(key)
    while i < n:
        c = key[i]
        if c == "\\":
            i += 2
        elif c == "{" and not _QUANTIFIER.match(key, i):
            return (f"holds a '{{' that is no {{m}} or {{m,n}} repeat: a literal brace to re (PEFT), which no module "
                    f"name holds, and a fuzzy-match constraint to the regex engine ({short_repr(key[i:i + 12])})")
        elif c == "[":
            i, why = _set_differs(key, i + 1)
            if why:
                return (f"holds a set that re (PEFT) and the regex engine read differently ({why}; '[[:alpha:]]' is "
                        f"a POSIX class to one, the characters '[:alph' to the other)")
        else:
            i += 1
    return ""


def _set_differs(key: str, i: int) -> tuple[int, str]:
    """Scan the set of ``key`` whose ``[`` ends at ``i``: where it ends, and why the two engines may read it
    differently ('' where they read it alike; see `_engines_differ`)."""
    n = len(key)
    if i < n and key[i] == "^":
        i += 1
    if i < n and key[i] == "[":
        return i, f"a nested set at character {i}"
    first = True  # a ']' first in a set is a character of it
    while i < n:
        c = key[i]
        if c == "]" and not first:
            return i + 1, ""
        if c in "-&~|" and not first and key[i + 1:i + 2] == c:
            return i, f"'{c}{c}', a set operation, at character {i}"
        i += 2 if c == "\\" else 1
        first = False
    return i, ""


@functools.lru_cache(maxsize=4096)
def _matcher(key: str) -> tuple[str, bool, Callable[..., Any]]:
    """How to match ``key``: a literal tail every name it matches ends with ('' where none is certain), whether it is
    plain (no metacharacter but ``.``, so it cannot backtrack), and the ``match`` of PEFT's own pattern,
    ``(.*\\.)?(key)$``, compiled as written: the same groups (a back-reference or a condition names the group it
    names in PEFT) and the same alternatives (a key holding ``)|(`` splits PEFT's pattern, and the plugin's).

    Plain keys use ``re``; the others ``regex``, whose match takes a timeout.
    """
    plain = not _REGEX_SYNTAX.intersection(key)
    i = len(key)
    while i and key[i - 1] not in _REGEX_SYNTAX and key[i - 1] != ".":
        i -= 1
    certain = ("|" not in key and "(?" not in key and ")" not in key
               and (i == 0 or key[i - 1] != "\\"))  # no alternation, flag, group, escape
    engine: Any = re if plain else regex
    return key[i:] if certain else "", plain, engine.compile(rf"(.*\.)?({key})$").match


def _pattern_key(patterns: Mapping[str, Any], module: str, field_name: str, adapter: str) -> str | None:
    # PEFT's get_pattern_key: the first key in order whose regex matches. A key that can backtrack gets
    # PATTERN_MATCH_TIMEOUT_S to match; together such keys get PATTERN_LOOKUP_CPU_S of this thread's CPU time per
    # module (many keys each just under the limit add up to no more; waits for a busy process's GIL do not count).
    spent = 0.0
    for key in patterns:
        tail, plain, match = _matcher(key)
        if not module.endswith(tail):
            continue
        if plain:
            if module == key or module.endswith("." + key) or match(module):
                return key
            continue
        t0 = time.thread_time()
        try:
            if _cpu_bounded(match, module):
                return key
        except TimeoutError:
            raise _too_slow(adapter, field_name, f"key {short_repr(key)}", PATTERN_MATCH_TIMEOUT_S, module) from None
        spent += time.thread_time() - t0
        if spent > PATTERN_LOOKUP_CPU_S:
            raise _too_slow(adapter, field_name, f"keys up to {short_repr(key)}", PATTERN_LOOKUP_CPU_S, module)
    return None


def _cpu_bounded(match: Callable[..., Any], module: str, attempts: int = 8) -> bool:
    """``match(module)`` given PATTERN_MATCH_TIMEOUT_S of this thread's CPU time. ``regex``'s own timeout is
    wall-clock, and a match that waited for the GIL (other threads of a busy server) timed out after 0.2 ms of CPU
    (6 of 3,000 beside 4 busy threads): such a timeout is tried again, up to ``attempts`` times.

    Raises:
        TimeoutError: the match took PATTERN_MATCH_TIMEOUT_S of CPU, or timed out ``attempts`` times.
    """
    t0 = time.thread_time()
    for _ in range(attempts - 1):
        try:
            return bool(match(module, timeout=PATTERN_MATCH_TIMEOUT_S))
        except TimeoutError:
            if time.thread_time() - t0 >= PATTERN_MATCH_TIMEOUT_S:
                raise
    return bool(match(module, timeout=PATTERN_MATCH_TIMEOUT_S))


def _too_slow(adapter: str, field_name: str, what: str, limit: float, module: str) -> AdapterFormatError:
    return AdapterFormatError(f"Adapter {adapter!r}: {field_name} {what} take{'s' if what.startswith('key ') else ''} "
                              f"over {limit} s to match {short_repr(module)} (nested repetition such as (a+)+). Write "
                              f"the module names in adapter_config.json instead.", adapter=adapter, key=field_name)


_REJECT = (
    ("use_dora", lambda v: bool(v), "DoRA (use_dora=true) is not supported by vLLM's LoRA kernels",
     "Merge the magnitude vector into the base model, or retrain without DoRA."),
    ("bias", lambda v: v not in (None, "none"), "LoRA bias training (bias != 'none') has no place in vLLM's LoRA layers",
     "Retrain with bias='none', or merge the biases into the base model."),
    ("lora_bias", lambda v: bool(v), "lora_bias=true adds bias terms vLLM cannot apply",
     "Retrain with lora_bias=false."),
    ("modules_to_save", lambda v: bool(v), "modules_to_save holds fully trained modules, which a LoRA slot cannot carry",
     "Merge those modules into the base model and serve the rest as LoRA."),
    ("fan_in_fan_out", lambda v: bool(v), "fan_in_fan_out=true (Conv1D-style weights) is not supported",
     "Re-save the adapter from an nn.Linear model."),
    # (vLLM 0.33 refuses these four too; 0.26 served them as a plain LoRA: an aLoRA on every token, not only after
    # its invocation tokens)
    ("alora_invocation_tokens", lambda v: bool(v), "Activated LoRA (alora_invocation_tokens) applies the adapter "
     "only after its invocation tokens, which vLLM's LoRA layers cannot do", "Serve a plain LoRA instead."),
    ("layer_replication", lambda v: bool(v), "layer_replication adds layers the base model does not have",
     "Serve the adapter on a model saved with those layers, or retrain without layer_replication."),
    ("use_qalora", lambda v: bool(v), "QALoRA (use_qalora=true) pools its input, which vLLM's LoRA layers do not",
     "Retrain without QALoRA."),
    ("use_bdlora", lambda v: bool(v), "block-diagonal LoRA (use_bdlora) is not supported by vLLM's LoRA kernels",
     "Retrain without BD-LoRA."),
)


def _check_supported(raw: Mapping[str, Any], name: str) -> None:
    problems: list[str] = []
    peft_type = raw.get("peft_type", "LORA")
    if isinstance(peft_type, str) and peft_type.upper() != "LORA":
        problems.append(f"peft_type={peft_type!r} is not LoRA (only LoRA adapters can be served); use a LoRA adapter")
    for key, bad, what, fix in _REJECT:
        if key in raw and bad(raw[key]):
            problems.append(f"{what}: {fix[0].lower()}{fix[1:]}")
    init = raw.get("init_lora_weights")
    if isinstance(init, str) and init.lower().split("_")[0] in {"pissa", "olora", "corda", "loftq"}:
        problems.append(f"init_lora_weights={init!r} changes the base weights, so the adapter alone is wrong on the "
                        f"original base model; convert it to a plain LoRA with PEFT first")
    if problems:
        raise AdapterFormatError(f"Adapter {name!r} cannot be served: " + "; ".join(p.rstrip(".") for p in problems)
                                 + ".", adapter=name, key=None)


def config_from_dict(raw: Mapping[str, Any], *, name: str = "adapter", inferred: bool = False) -> AdapterConfig:
    """Build an [`AdapterConfig`] from a parsed config mapping, rejecting what vLLM cannot serve."""
    _check_types(raw, name)
    _check_supported(raw, name)
    if "r" not in raw:
        raise AdapterFormatError(f"Adapter {name!r}: config has no rank 'r'. Add \"r\": <rank> to its config.",
                                 adapter=name, key="r")
    r = raw["r"]
    alpha = raw.get("lora_alpha", r)
    tm = raw.get("target_modules")
    tp = raw.get("target_parameters")
    return AdapterConfig(
        r=int(r) if type(r) is float and r.is_integer() else r,
        lora_alpha=float(alpha) if _is_number(alpha) else alpha,
        use_rslora=raw.get("use_rslora") or False,
        rank_pattern=dict(raw.get("rank_pattern") or {}),
        alpha_pattern={k: (float(v) if _is_number(v) else v) for k, v in (raw.get("alpha_pattern") or {}).items()},
        target_modules=tuple(tm) if isinstance(tm, (list, tuple)) else tm,
        target_parameters=tuple(tp) if tp else None,
        peft_version=raw.get("peft_version"),
        base_model_name_or_path=raw.get("base_model_name_or_path"),
        inferred=inferred,
        raw=dict(raw),
        name=name,
    )


def read_config(path: str | os.PathLike[str], *, name: str = "adapter",
                roots: Sequence[str] | None = None) -> AdapterConfig:
    """Read and validate an ``adapter_config.json`` (with ``roots``: only if its real path lies in one).

    Raises:
        [`AdapterFormatError`]: the file is not JSON, not an object, or asks for an unsupported feature.
    """
    p = Path(path)
    try:
        raw = read_json_capped(p, MAX_CONFIG_BYTES, f"Adapter {name!r}: config", roots=roots, adapter=name,
                               fix="fix or replace it.")
    except OSError as err:
        if isinstance(err, VllmLoraExtError):  # outside the allowed roots
            raise
        raise AdapterFormatError(f"Adapter {name!r}: config {str(p)!r} could not be read ({clip(str(err))}). Fix or "
                                 f"replace it.", adapter=name, key=None) from None  # (e.g. gone since found)
    config = config_from_dict(raw, name=name)  # its types, features and rank first: a LoHa names no alpha either
    if alpha_missing(raw):
        raise AdapterFormatError(
            f"Adapter {name!r}: config {str(p)!r} has no 'lora_alpha', so its scaling is unknown: PEFT reads a missing "
            f"one as 8 (scaling 8/r), other tools as r (scaling 1). Add \"lora_alpha\": <alpha> as it was trained.",
            adapter=name, key="lora_alpha")
    return config


def alpha_missing(raw: Any) -> bool:
    """Whether a config file's mapping names no ``lora_alpha``: refused from a file ([`read_config`]), where tools
    disagree on what it means; [`config_from_dict`] takes ``r`` for it, for a config built in code."""
    return isinstance(raw, Mapping) and "lora_alpha" not in raw


def infer_config(shapes: Mapping[str, tuple[int, ...]], metadata: Mapping[str, str] | None, *,
                 name: str = "adapter") -> AdapterConfig:
    """Infer a config for a bare weight file: rank from ``lora_A`` shapes, alpha from the file's metadata.

    Raises:
        [`AdapterFormatError`]: ranks differ between modules with no metadata to settle them, or no alpha is
            recorded in the metadata.
    """
    meta = dict(metadata or {})
    ranks = sorted({s[0] for k, s in shapes.items() if k.endswith("lora_A.weight") and len(s) == 2})
    meta_rank = next((meta[k] for k in METADATA_RANK_KEYS if k in meta), None)
    if meta_rank is not None:
        try:
            r = int(meta_rank)
        except ValueError:
            raise AdapterFormatError(f"Adapter {name!r}: the rank {short_repr(meta_rank)} in its safetensors metadata "
                                     f"is not an integer. Add an adapter_config.json with \"r\".", adapter=name,
                                     key="r") from None
    elif len(ranks) == 1:
        r = ranks[0]
    elif not ranks:
        raise AdapterFormatError(f"Adapter {name!r}: no config file and no lora_A tensors to infer the rank from. "
                                 f"Add an adapter_config.json beside the weight file.", adapter=name, key=None)
    else:
        raise AdapterFormatError(f"Adapter {name!r}: no config file and the lora_A ranks differ ({ranks}). "
                                 f"Add an adapter_config.json with r and rank_pattern beside the weight file.",
                                 adapter=name, key=None)
    alpha_s = next((meta[k] for k in METADATA_ALPHA_KEYS if k in meta), None)
    if alpha_s is None:
        raise AdapterFormatError(
            f"Adapter {name!r}: no config file beside the weight file and no 'lora_alpha' in its safetensors metadata, "
            f"so its scaling is unknown (rank {r} was inferred from the shapes). Add an adapter_config.json "
            f"(or '<stem>_config.json') with \"r\" and \"lora_alpha\", or save the file with metadata "
            f"{{'lora_alpha': '<alpha>'}}.", adapter=name, key="lora_alpha")
    try:
        alpha = float(alpha_s)
    except ValueError:
        alpha = math.nan
    if not math.isfinite(alpha):
        raise AdapterFormatError(f"Adapter {name!r}: lora_alpha {short_repr(alpha_s)} in its safetensors metadata is "
                                 f"not a finite number. Add an adapter_config.json with \"lora_alpha\".",
                                 adapter=name, key="lora_alpha")
    rslora = meta.get("use_rslora", "false").strip().lower()
    if rslora not in ("true", "false"):
        raise AdapterFormatError(f"Adapter {name!r}: use_rslora {short_repr(rslora)} in its safetensors metadata must "
                                 f"be 'true' or 'false'.", adapter=name, key="use_rslora")
    modules = sorted({k.split(".lora_A.")[0].rsplit(".", 1)[-1] for k in shapes if ".lora_A." in k})
    raw = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": modules,
           "use_rslora": rslora == "true"}
    return config_from_dict(raw, name=name, inferred=True)
