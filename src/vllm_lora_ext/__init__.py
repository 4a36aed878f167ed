"""vllm_lora_ext: LoRA serving for the adapters people actually have.

The public API below is the pure core: it imports neither vLLM nor anything CUDA. The vLLM
integration lives in `vllm_lora_ext.integration` and is loaded by vLLM's plugin system.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_lora_ext.errors import (
    AdapterAccessError,
    AdapterCompatibilityError,
    AdapterDownloadError,
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterSourceError,
    BuildProcessError,
    DeploymentConfigError,
    ExpertLayoutError,
    KernelConfigError,
    MixCapacityError,
    MixError,
    MixIdCollisionError,
    OutputPathError,
    UnmatchedKeysError,
    UnsafeFormatError,
    UnsupportedVLLMError,
    VllmLoraExtError,
)

# The rest of the API is loaded on first use, so `vllm-lora --help` and input errors answer fast (reading
# headers does not import torch; reading tensors does, 1-2 s).
_LAZY = {
    "AdapterConfig": "config", "infer_config": "config", "read_config": "config",
    "classify_key": "formats", "detect_layout": "formats",
    "read_header": "reader", "read_tensors": "reader",
    "AdapterSource": "sources", "ResolvedAdapter": "sources", "parse_source": "sources", "resolve_source": "sources",
    "AdapterSummary": "summary", "summarize_adapter": "summary",
}

if TYPE_CHECKING:
    from vllm_lora_ext.config import AdapterConfig, infer_config, read_config
    from vllm_lora_ext.formats import classify_key, detect_layout
    from vllm_lora_ext.reader import read_header, read_tensors
    from vllm_lora_ext.sources import AdapterSource, ResolvedAdapter, parse_source, resolve_source
    from vllm_lora_ext.summary import AdapterSummary, summarize_adapter


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vllm_lora_ext' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"vllm_lora_ext.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "AdapterAccessError",
    "AdapterCompatibilityError",
    "AdapterConfig",
    "AdapterDownloadError",
    "AdapterFormatError",
    "AdapterNotFoundError",
    "AdapterSource",
    "AdapterSourceError",
    "AdapterSummary",
    "BuildProcessError",
    "DeploymentConfigError",
    "ExpertLayoutError",
    "KernelConfigError",
    "MixCapacityError",
    "MixError",
    "MixIdCollisionError",
    "OutputPathError",
    "ResolvedAdapter",
    "UnmatchedKeysError",
    "UnsafeFormatError",
    "UnsupportedVLLMError",
    "VllmLoraExtError",
    "__version__",
    "classify_key",
    "detect_layout",
    "infer_config",
    "parse_source",
    "read_config",
    "read_header",
    "read_tensors",
    "resolve_source",
    "summarize_adapter",
]
