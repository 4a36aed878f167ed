"""DeploymentConfig: the named adapters of one deployment (JSON or YAML), pointed to by ``VLLM_LORA_EXT_CONFIG``.

Format::

    adapters:
      sql:   {source: "hf:acme/loras@v2:sql.safetensors", weight: 1.0}
      style: {source: /models/style, weight: 0.7}
      chat:  hf:acme/chat-lora            # a bare string is the source, weight 1.0
    default: sql                          # optional: applied to requests that name the base model

Names follow vLLM's model-name rules for adapters: 1–128 characters of letters, digits and
``_ . - /``, not starting with ``-``. The mix grammar's rule (`vllm_lora_ext.naming`: no ``+`` or
``=``, no ``mix-`` prefix) is checked first, so such a name is refused with that rule's message. A name given twice
is an error (in YAML and JSON alike). Weights follow the one weight rule (finite, ``|w| <= 100``).
Every source is parsed (not resolved) when the file is read, so a typo fails at start-up.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_lora_ext._util import read_capped, short_repr
from vllm_lora_ext.constants import MAX_CONFIG_BYTES, MIX_NAME_PREFIX
from vllm_lora_ext.errors import AdapterSourceError, DeploymentConfigError, MixError
from vllm_lora_ext.mixing import check_weight
from vllm_lora_ext.naming import check_adapter_name
from vllm_lora_ext.sources import AdapterSource, parse_source

__all__ = ["DeploymentAdapter", "DeploymentConfig", "DeploymentConfigError", "read_deployment_config"]

_NAME = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_./\-]{0,127}$")


@dataclass(frozen=True)
class DeploymentAdapter:
    """One named adapter: its source and default mixing weight."""

    name: str
    source: AdapterSource
    weight: float = 1.0


@dataclass(frozen=True)
class DeploymentConfig:
    """All named adapters and the optional default adapter."""

    adapters: Mapping[str, DeploymentAdapter] = field(default_factory=dict)
    default: str | None = None
    path: Path | None = None

    def __post_init__(self) -> None:
        if self.default is not None and self.default not in self.adapters:
            raise DeploymentConfigError(
                f"Deployment config {str(self.path)!r}: default adapter {short_repr(self.default)} is not among the "
                f"adapters {short_repr(sorted(self.adapters))}. Name one of them or remove 'default'.")

    def get(self, name: str) -> DeploymentAdapter:
        """Return the named adapter, or raise listing the known names."""
        try:
            return self.adapters[name]
        except KeyError:
            raise DeploymentConfigError(
                f"Unknown adapter {short_repr(name)}; the deployment defines {short_repr(sorted(self.adapters))}.") from None


def _check_name(name: str, *, where: str) -> None:
    """Raise unless ``name`` is a valid adapter name: the mix grammar's rule first, then the config's stricter form."""
    try:
        if not isinstance(name, str) or name == name.strip():  # (spaces: the config's own rule below says more)
            check_adapter_name(name)
    except AdapterSourceError as err:
        raise DeploymentConfigError(f"{where}: {err}") from None
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise DeploymentConfigError(
            f"{where}: Invalid adapter name {short_repr(name)}: use 1-128 letters, digits, '_', '.', '-' or '/', not "
            f"starting with '-' (no spaces, ',', ':' or '@'; '+', '=' and the prefix '{MIX_NAME_PREFIX}' are reserved "
            f"for mixes).")


def _check_weight(name: str, weight: Any, *, where: str) -> float:
    try:
        return check_weight(weight, name=name)
    except MixError as err:
        raise DeploymentConfigError(f"{where}: {err}") from None


def config_from_mapping(raw: Mapping[str, Any], *, path: Path | None = None) -> DeploymentConfig:
    """Build a [`DeploymentConfig`] from parsed JSON/YAML, checking every name, source and weight."""
    where = f"Deployment config {str(path)!r}" if path else "Deployment config"
    if not isinstance(raw, Mapping):
        raise DeploymentConfigError(f"{where} must be a mapping with 'adapters' (and optionally 'default').")
    unknown = set(raw) - {"adapters", "default"}
    if unknown:
        raise DeploymentConfigError(f"{where} has unknown keys {short_repr(sorted(map(str, unknown)))}; only 'adapters' "
                                    f"and 'default' exist.")
    entries = raw.get("adapters") or {}
    if not isinstance(entries, Mapping):
        raise DeploymentConfigError(f"{where}: 'adapters' must map names to sources or {{source, weight}}.")
    adapters: dict[str, DeploymentAdapter] = {}
    for name, entry in entries.items():
        _check_name(name, where=where)
        if isinstance(entry, str):
            entry = {"source": entry}
        if not isinstance(entry, Mapping) or "source" not in entry:
            raise DeploymentConfigError(f"{where}: adapter {name!r} needs a 'source'.")
        extra = set(entry) - {"source", "weight"}
        if extra:
            raise DeploymentConfigError(f"{where}: adapter {name!r} has unknown keys {short_repr(sorted(map(str, extra)))}; "
                                        f"an adapter takes 'source' and 'weight'.")
        if not isinstance(entry["source"], str):
            raise DeploymentConfigError(f"{where}: adapter {name!r}: 'source' must be a string such as "
                                        f"'hf:org/repo' or a path, got {short_repr(entry['source'])}.")
        raw_source = entry["source"]
        if path is not None and raw_source.startswith(("./", "../")):  # explicitly relative: to the config's folder
            raw_source = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), raw_source))
        try:
            source = parse_source(raw_source)
        except AdapterSourceError as err:
            raise DeploymentConfigError(f"{where}: adapter {name!r}: {err}") from err
        adapters[name] = DeploymentAdapter(name, source, _check_weight(name, entry.get("weight", 1.0), where=where))
    default = raw.get("default")
    if default is not None and not isinstance(default, str):
        raise DeploymentConfigError(f"{where}: 'default' must be an adapter name, got {short_repr(default)}.")
    return DeploymentConfig(adapters=adapters, default=default, path=path)


def read_deployment_config(path: str | os.PathLike[str]) -> DeploymentConfig:
    """Read a deployment config file (``.json``, ``.yaml`` or ``.yml``).

    Raises:
        [`DeploymentConfigError`]: the file is missing, unparsable, or names invalid adapters.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "d.yaml"
        >>> _ = p.write_text("adapters:\\n  sql: {source: 'hf:acme/sql', weight: 0.5}\\ndefault: sql\\n")
        >>> read_deployment_config(p).get("sql").weight
        0.5
    """
    p = Path(os.path.expanduser(path))
    try:
        data, too_big = read_capped(p, MAX_CONFIG_BYTES)
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise DeploymentConfigError(f"Cannot read deployment config {str(p)!r}: {err}. Check VLLM_LORA_EXT_CONFIG.") from err
    if too_big:
        raise DeploymentConfigError(f"Deployment config {str(p)!r} is larger than {MAX_CONFIG_BYTES} bytes. Split it or "
                                    f"check VLLM_LORA_EXT_CONFIG points at the right file.")
    try:
        raw = _load_yaml(text) if p.suffix.lower() in (".yaml", ".yml") else json.loads(text, object_pairs_hook=_unique_json)
    except DeploymentConfigError as err:
        raise DeploymentConfigError(f"Deployment config {str(p)!r}: {err}") from None
    except Exception as err:
        raise DeploymentConfigError(f"Deployment config {str(p)!r} is not valid {p.suffix.lstrip('.') or 'JSON'}: "
                                    f"{str(err)[:300]}") from None
    return config_from_mapping(raw or {}, path=p)


def _unique_json(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DeploymentConfigError(f"{short_repr(k)} is given twice; each name may appear once.")
        out[k] = v
    return out


def _load_yaml(text: str) -> Any:
    import yaml  # type: ignore[import-untyped]

    class _UniqueLoader(yaml.SafeLoader):
        pass

    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in out:
                raise DeploymentConfigError(f"{short_repr(key)} is given twice (line {key_node.start_mark.line + 1}); "
                                            f"each name may appear once.")
            out[key] = loader.construct_object(value_node, deep=deep)
        return out

    _UniqueLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return yaml.load(text, Loader=_UniqueLoader)  # noqa: S506 (a SafeLoader subclass)
