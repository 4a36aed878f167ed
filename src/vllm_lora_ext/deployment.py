"""DeploymentConfig: the named adapters of one deployment (JSON or YAML), pointed to by ``VLLM_LORA_EXT_CONFIG``.

Format::

    adapters:
      sql:   {source: "hf:acme/loras@v2:sql.safetensors", weight: 1.0}
      style: {source: /models/style, weight: 0.7}
      chat:  hf:acme/chat-lora            # a bare string is the source, weight 1.0
    default: sql                          # optional: applied to requests that name the base model

Names follow vLLM's model-name rules for adapters: 1–128 characters of letters, digits and
``_ . - /``, not starting with ``-``; ``+``, ``=``, ``,``, ``:`` and ``@`` are reserved for the
mix syntax. Every source is parsed (not resolved) when the file is read, so a typo fails at start-up.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_lora_ext.errors import AdapterSourceError, VllmLoraExtError
from vllm_lora_ext.sources import AdapterSource, parse_source

__all__ = ["DeploymentAdapter", "DeploymentConfig", "DeploymentConfigError", "read_deployment_config"]

_NAME = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_./\-]{0,127}$")


class DeploymentConfigError(VllmLoraExtError, ValueError):
    """The deployment config file is unreadable or inconsistent."""


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
                f"Deployment config {str(self.path)!r}: default adapter {self.default!r} is not among the adapters "
                f"{sorted(self.adapters)}. Name one of them or remove 'default'.")

    def get(self, name: str) -> DeploymentAdapter:
        """Return the named adapter, or raise listing the known names."""
        try:
            return self.adapters[name]
        except KeyError:
            raise DeploymentConfigError(
                f"Unknown adapter {name!r}; the deployment defines {sorted(self.adapters)}.") from None


def check_adapter_name(name: str, *, where: str = "adapter") -> None:
    """Raise unless ``name`` is a valid adapter name (see the module docstring)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise DeploymentConfigError(
            f"Invalid {where} name {name!r}: use 1-128 letters, digits, '_', '.', '-' or '/', not starting with '-' "
            f"('+', '=', ',', ':' and '@' are reserved for mixes).")


def _check_weight(name: str, weight: Any) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(float(weight)):
        raise DeploymentConfigError(f"Adapter {name!r}: weight {weight!r} must be a finite number.")
    return float(weight)


def config_from_mapping(raw: Mapping[str, Any], *, path: Path | None = None) -> DeploymentConfig:
    """Build a [`DeploymentConfig`] from parsed JSON/YAML, checking every name, source and weight."""
    where = f"Deployment config {str(path)!r}" if path else "Deployment config"
    if not isinstance(raw, Mapping):
        raise DeploymentConfigError(f"{where} must be a mapping with 'adapters' (and optionally 'default').")
    unknown = set(raw) - {"adapters", "default"}
    if unknown:
        raise DeploymentConfigError(f"{where} has unknown keys {sorted(unknown)}; only 'adapters' and 'default' exist.")
    entries = raw.get("adapters") or {}
    if not isinstance(entries, Mapping):
        raise DeploymentConfigError(f"{where}: 'adapters' must map names to sources or {{source, weight}}.")
    adapters: dict[str, DeploymentAdapter] = {}
    for name, entry in entries.items():
        check_adapter_name(name)
        if isinstance(entry, str):
            entry = {"source": entry}
        if not isinstance(entry, Mapping) or "source" not in entry:
            raise DeploymentConfigError(f"{where}: adapter {name!r} needs a 'source'.")
        extra = set(entry) - {"source", "weight"}
        if extra:
            raise DeploymentConfigError(f"{where}: adapter {name!r} has unknown keys {sorted(extra)}.")
        try:
            source = parse_source(entry["source"])
        except AdapterSourceError as err:
            raise DeploymentConfigError(f"{where}: adapter {name!r}: {err}") from err
        adapters[name] = DeploymentAdapter(name, source, _check_weight(name, entry.get("weight", 1.0)))
    default = raw.get("default")
    if default is not None and not isinstance(default, str):
        raise DeploymentConfigError(f"{where}: 'default' must be an adapter name.")
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
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as err:
        raise DeploymentConfigError(f"Cannot read deployment config {str(p)!r}: {err}. Check VLLM_LORA_EXT_CONFIG.") from err
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            raw = yaml.safe_load(text)
        else:
            raw = json.loads(text)
    except Exception as err:
        raise DeploymentConfigError(f"Deployment config {str(p)!r} is not valid {p.suffix.lstrip('.') or 'JSON'}: {err}") from err
    return config_from_mapping(raw or {}, path=p)
