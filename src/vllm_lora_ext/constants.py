"""File names, key fragments, environment variables and their defaults.

Environment variables are read when a call runs (through the accessors below), never at import
time, so tests and offline switches behave.
"""

from __future__ import annotations

import os
from typing import Literal

HF_PREFIX = "hf:"
MIX_PREFIX = "mix:"

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_WEIGHTS_NAMES = ("adapter_model.bin", "adapter_model.pt")
SAFETENSORS_SUFFIX = ".safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
# Metadata keys in a bare .safetensors file that may carry the adapter's hyper-parameters.
METADATA_ALPHA_KEYS = ("lora_alpha", "alpha", "ss_network_alpha")
METADATA_RANK_KEYS = ("r", "rank", "lora_rank", "ss_network_dim")

# vLLM releases this plugin is tested against (inclusive lower, exclusive upper bound).
SUPPORTED_VLLM_MIN = "0.26.0"
SUPPORTED_VLLM_MAX_EXCLUSIVE = "0.27.0"
# max_lora_rank values vLLM accepts.
VLLM_MAX_LORA_RANK_CHOICES = (1, 8, 16, 32, 64, 128, 256, 320, 512)



def max_lora_rank_for(rank: int) -> int | None:
    """Return the smallest ``--max-lora-rank`` vLLM accepts that fits ``rank`` (``None`` if none does)."""
    return next((c for c in VLLM_MAX_LORA_RANK_CHOICES if c >= rank), None)


ENV_ALLOW_UNSUPPORTED_VLLM = "VLLM_LORA_EXT_ALLOW_UNSUPPORTED_VLLM"
ENV_LOG_LEVEL = "VLLM_LORA_EXT_LOG_LEVEL"
ENV_ALLOW_PICKLE = "VLLM_LORA_EXT_ALLOW_PICKLE"
ENV_DISABLE = "VLLM_LORA_EXT_DISABLE"
ENV_CONFIG = "VLLM_LORA_EXT_CONFIG"
ENV_ALLOW_UNMATCHED = "VLLM_LORA_EXT_ALLOW_UNMATCHED_KEYS"

SourceKind = Literal["hf", "local"]
TargetKind = Literal["dir", "file"]

_TRUE = {"1", "true", "yes", "on"}


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def allow_unsupported_vllm() -> bool:
    """Return whether the user asked to run on an untested vLLM version anyway."""
    return _env_flag(ENV_ALLOW_UNSUPPORTED_VLLM)


def allow_pickle() -> bool:
    """Return whether pickle weight files (.bin/.pt) may be read (with ``weights_only=True``)."""
    return _env_flag(ENV_ALLOW_PICKLE)


def plugin_disabled() -> bool:
    """Return whether the plugin was switched off for this process."""
    return _env_flag(ENV_DISABLE)


def allow_unmatched_keys() -> bool:
    """Return whether keys that map to no module are only warned about instead of refused."""
    return _env_flag(ENV_ALLOW_UNMATCHED)


def hf_offline() -> bool:
    """Return whether huggingface_hub must not touch the network (``HF_HUB_OFFLINE``)."""
    return _env_flag("HF_HUB_OFFLINE")


def log_level() -> str:
    """Return the plugin's log level name (default INFO)."""
    return os.environ.get(ENV_LOG_LEVEL, "INFO").strip().upper() or "INFO"


def deployment_config_path() -> str | None:
    """Return the path of the deployment config file, if one is set."""
    value = os.environ.get(ENV_CONFIG, "").strip()
    return value or None
