"""``vllm-lora mix NAME=W [NAME=W ...] -o DIR``: write the exact weighted mix as a standard PEFT adapter.

A ``NAME`` is looked up in the deployment config given with ``--config``, else in the one
``VLLM_LORA_EXT_CONFIG`` names; anything that is not a name there is read as a source (a local folder or
file, ``hf:org/repo``). A missing ``=W`` takes the config's default weight (else 1).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_lora_ext.cli._args import add_base_config, add_output, plural, resolve_offline
from vllm_lora_ext.constants import (ADAPTER_WEIGHTS_NAME, ENV_CONFIG, HF_PREFIX, MAX_MIX_COMPONENTS,
                                     deployment_config_path)
from vllm_lora_ext.errors import DeploymentConfigError, MixError
from vllm_lora_ext.outputs import claim_output
from vllm_lora_ext.mixing import check_weight, parse_mix_expression, parse_weight  # (imports no torch)
from vllm_lora_ext.sources import ResolvedAdapter

if TYPE_CHECKING:  # the writing modules import torch: loaded only when mixing
    from vllm_lora_ext.deployment import DeploymentConfig


def add_parser(sub: Any) -> None:
    p = sub.add_parser("mix", help="write Σ w·s·B·A of several adapters (rank concatenation) as one PEFT adapter",
                       description="Write the exact weighted mix Σ w·s·B·A of adapters (rank concatenation, no cross "
                                   "terms) as one standard PEFT adapter with scaling 1 per module. MoE blocks are "
                                   "written as 2D per-expert keys (3D inputs too); vllm_lora_ext_mix.json beside it "
                                   "records the inputs' pinned sources and weights. Inputs must fit the same base "
                                   "model; they are checked as the loader checks them before anything is written.")
    p.add_argument("items", nargs="+", metavar="NAME_OR_SOURCE=WEIGHT",
                   help=f"a name from --config (else {ENV_CONFIG}) or a source; '=WEIGHT' defaults to the config's "
                        f"weight, else 1; at most {MAX_MIX_COMPONENTS}. The model syntax works too: 'a=0.7+b=0.3', "
                        f"or 'a+b' for config names")
    add_output(p, folder="output folder", over="over a source")
    p.add_argument("--config", default=None, metavar="FILE", help=f"deployment config naming the adapters (default: {ENV_CONFIG})")
    add_base_config(p, needed_for="MoE sizes of 3D inputs whose own shapes allow more than one reading")
    p.set_defaults(func=run, fewer="mix fewer adapters")  # (said where its own sources fill the disk bound)


def _deployment(option: str | None) -> tuple[DeploymentConfig | None, str]:
    """The deployment config in use and how it was chosen (for messages)."""
    if option is not None:
        path, how = Path(os.path.expanduser(option)), f"--config {option}"
    elif deployment_config_path() is not None:
        path, how = Path(os.path.expanduser(deployment_config_path() or "")), f"{ENV_CONFIG}={deployment_config_path()}"
    else:
        return None, f"no deployment config (pass --config FILE or set {ENV_CONFIG})"
    if not path.is_file():
        state = "is a folder" if path.is_dir() else "does not exist" if not path.exists() else "is not a regular file"
        raise DeploymentConfigError(f"Deployment config {str(path)!r} (from {how}) {state}. Name the JSON or YAML file "
                                    f"that maps adapter names to sources.")
    from vllm_lora_ext.deployment import read_deployment_config

    try:
        return read_deployment_config(path), f"deployment config {str(path)!r} (from {how})"
    except DeploymentConfigError as err:
        text = str(err).replace(f" Check {ENV_CONFIG}.", "").replace(f"check {ENV_CONFIG} points at", "check it is")
        raise DeploymentConfigError(f"{text} (from {how})") from err


def _resolve_item(name: str, dep: DeploymentConfig | None, where: str) -> tuple[ResolvedAdapter, float]:
    if dep is not None and name in dep.adapters:
        entry = dep.adapters[name]
        return resolve_offline(entry.source.canonical()), entry.weight
    if not name.startswith(HF_PREFIX) and not Path(os.path.expanduser(name)).exists() and "/" not in name.strip("/"):
        if dep is None:
            raise MixError(f"{name!r} is no local adapter folder, and there is {where} to look the name up in. Give a "
                           f"local adapter folder or hf:org/repo, or name the deployment config.")
        raise MixError(f"{name!r} is not an adapter name of {where}, and no local folder {name!r} exists. It names "
                       f"{sorted(dep.adapters)[:10]}. Give a name it defines, a local adapter folder, or hf:org/repo.")
    return resolve_offline(name), 1.0


def _split_items(items: list[str], names: frozenset[str] = frozenset()) -> list[str]:
    """The items, with one written in the model syntax (``a=0.7+b=0.3``, ``a+b`` of config ``names``) split at its
    ``+``: only where every part is ``NAME=WEIGHT`` or one of ``names``, so ``hf:org/repo@v1+build``, ``a=1e+0``
    and an existing path holding ``+`` stay whole."""
    def component(part: str) -> bool:
        name, eq, weight = part.rpartition("=")
        return bool(name and weight) if eq else part.strip() in names

    out: list[str] = []
    for item in items:
        parts = item.split("+")
        whole = (len(parts) < 2 or os.path.exists(item) or os.path.exists(item.rpartition("=")[0])
                 or not all(component(p) for p in parts))
        out.extend([item] if whole else parts)
    return out


def _refuse_unknown_names(items: list[str], dep: DeploymentConfig | None, where: str) -> None:
    """Name the parts of an item in the model syntax that the config does not define (``style+nosuch``), where
    others are its names: the item was kept whole, and would be refused as one unknown name."""
    for item in items:
        if dep is None or "+" not in item or os.path.exists(item):
            continue
        try:
            named = [name for name, _ in parse_mix_expression(item)]
        except MixError:  # no mix in the model syntax ('a=1e+0', a source holding '+'): read as before
            continue
        unknown = [n for n in named if n not in dep.adapters]
        if unknown and len(unknown) < len(named):
            raise MixError(f"Mix {item!r} names {unknown}, which {where} does not define; it defines "
                           f"{sorted(dep.adapters)[:10]}. Give names it defines.")


def run(args: argparse.Namespace) -> int:
    dep, where = _deployment(args.config)
    args.items = _split_items(args.items, frozenset(dep.adapters) if dep is not None else frozenset())
    _refuse_unknown_names(args.items, dep, where)
    if len(args.items) > MAX_MIX_COMPONENTS:
        raise MixError(f"{len(args.items)} adapters is more than the {MAX_MIX_COMPONENTS} one mix may have.")
    items: list[tuple[str, ResolvedAdapter, float]] = []
    for item in args.items:  # every source and weight first, before torch is imported: a bad one answers at once
        name, eq, weight = item.rpartition("=")
        if not eq:
            name, weight = item, ""
        elif not weight.strip():  # "a=" (an unset $W): not the default weight, silently
            raise MixError(f"{item!r} has nothing after '='. Give a weight ({name}=0.5), or no '=' for "
                           f"{'its configured' if dep is not None else 'the default'} weight.")
        resolved, default = _resolve_item(name, dep, where)
        items.append((name, resolved, parse_weight(weight, name=name) if weight else check_weight(default, name=name)))
    with claim_output(args.output, inputs=[r.weights_path for _, r, _ in items], force=args.force) as out:  # too
        from vllm_lora_ext.offline_ops import load_base_config, require_safetensors
        from vllm_lora_ext.offline_writes import mix_adapter_files

        pairs: list[tuple[ResolvedAdapter, float]] = []
        names = [name for name, *_ in items]
        for name, resolved, w in items:
            require_safetensors(resolved, name=name)
            pairs.append((resolved, w))
        if not getattr(args, "quiet", False):  # (-q: errors only; the notes are advice)
            _say_doubtful(items)
        base = load_base_config(args.base_config) if args.base_config else None
        if base is not None and not getattr(args, "quiet", False):
            _say_unapplied(pairs, base)
        mix_adapter_files(pairs, out, base_config=base, names=names)
    used = f"; names from {where}" if dep is not None else ""
    print(f"wrote {out.path} (rank-concatenated mix of {plural(len(pairs), 'adapter')}{used})")
    if not getattr(args, "quiet", False):
        _say_widened(pairs, names, out.path)
    return 0


def _say_doubtful(items: list[tuple[str, ResolvedAdapter, float]]) -> None:
    """Say on stderr what is allowed but likely a mistake: a weight of 0 (the component adds its rank and nothing
    else), one adapter twice (its rank counts twice), inputs trained on different base models."""
    from vllm_lora_ext.summary import load_config

    seen: dict[str, str] = {}
    said: set[tuple[str, str]] = set()  # (adapter, name): each repeat said once, however often it is given
    for name, resolved, weight in items:
        if weight == 0:
            print(f"note: {name} has weight 0: it adds its rank to the mix and nothing to its output", file=sys.stderr)
        key = os.path.realpath(resolved.weights_path)
        if key in seen and (key, name) not in said:
            said.add((key, name))
            same = "is given twice" if seen[key] == name else f"is the same adapter as {seen[key]}"
            print(f"note: {name} {same}: its rank counts twice; give it once, with the sum of the weights",
                  file=sys.stderr)
        seen.setdefault(key, name)
    bases = {name: load_config(resolved, name=name).base_model_name_or_path for name, resolved, _ in items}
    if len({b for b in bases.values() if b}) > 1:
        named = ", ".join(f"{n}: {b}" for n, b in bases.items() if b)
        print(f"note: the inputs were trained on different base models ({named}); their shapes fit, but a mix is "
              f"meant for one base model", file=sys.stderr)


def _say_unapplied(pairs: list[tuple[ResolvedAdapter, float]], base: Any) -> None:
    """Say on stderr which modules of the mix vLLM would accept and not apply on ``base`` (``inspect
    --base-config`` lists them as problems; a server with this plugin refuses them at load)."""
    from vllm_lora_ext.formats import group_modules
    from vllm_lora_ext.headers import read_header
    from vllm_lora_ext.unapplied import unapplied_on_base

    modules = dict.fromkeys(m for r, _ in pairs for m in group_modules(read_header(r.weights_path).tensors))
    notes, problems = unapplied_on_base(list(modules), base)
    for line in [*notes, *(f"note: on this base model, {p}" for p in problems)]:
        print(line, file=sys.stderr)


def _say_widened(pairs: list[tuple[ResolvedAdapter, float]], names: list[str], out: Path) -> None:
    """Name the dtypes when the inputs' differ: the mix is written in the widest (`mixing.widest_dtype`)."""
    from vllm_lora_ext.headers import read_header

    held = {n: sorted(set(read_header(r.weights_path).dtypes.values())) for (r, _), n in zip(pairs, names)}
    if len({d for ds in held.values() for d in ds}) > 1:
        written = sorted(set(read_header(out / ADAPTER_WEIGHTS_NAME).dtypes.values()))
        inputs = "; ".join(f"{n}: {'/'.join(ds)}" for n, ds in held.items())
        print(f"note: the inputs' dtypes differ ({inputs}); the mix is written in {'/'.join(written)}: each module "
              f"in the widest dtype of the inputs that have it, its weights and scalings folded into A there",
              file=sys.stderr)
