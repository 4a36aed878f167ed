"""vllm_lora_ext: LoRA serving for the adapters people actually have.

The public API below is the pure core: it imports neither vLLM nor anything CUDA. The vLLM
integration lives in `vllm_lora_ext.integration` and is loaded by vLLM's plugin system.
"""

from __future__ import annotations

from vllm_lora_ext.config import AdapterConfig, infer_config, read_config
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
from vllm_lora_ext.formats import classify_key, detect_layout
from vllm_lora_ext.reader import read_header, read_tensors
from vllm_lora_ext.sources import AdapterSource, ResolvedAdapter, parse_source, resolve_source
from vllm_lora_ext.summary import AdapterSummary, summarize_adapter

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
