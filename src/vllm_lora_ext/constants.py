"""File names, key fragments, environment variables and their defaults.

Environment variables are read when a call runs (through the accessors below), never at import
time, so tests and offline switches behave.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
from typing import Literal

from vllm_lora_ext._util import clip, endpoint_unreadable, not_a_regular_file, parse_size
from vllm_lora_ext.errors import SettingsError

logger = logging.getLogger(__name__)
SETTING_PREFIX = "VLLM_LORA_EXT_"  # every ENV_* name below starts so

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
SUPPORTED_VLLM_MAX_EXCLUSIVE = "0.34.0"
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
ENV_MAX_MIXES = "VLLM_LORA_EXT_MAX_MIXES"
ENV_MIX_WAIT = "VLLM_LORA_EXT_MIX_WAIT_S"
ENV_ALLOWED_ROOTS = "VLLM_LORA_EXT_ALLOWED_ROOTS"
ENV_METRICS_DIR = "VLLM_LORA_EXT_METRICS_DIR"  # set by the plugin for the processes vLLM starts
ENV_PREBUILD = "VLLM_LORA_EXT_PREBUILD"  # 0: build adapters inside the engine step, as stock vLLM does
ENV_PREBUILD_BUILDS = "VLLM_LORA_EXT_PREBUILD_BUILDS"
ENV_PREBUILD_BYTES = "VLLM_LORA_EXT_PREBUILD_BYTES"
ENV_PREBUILD_WAIT = "VLLM_LORA_EXT_PREBUILD_WAIT_S"
ENV_BUILD_AT_START = "VLLM_LORA_EXT_BUILD_AT_START"  # 0: deployment names checked at start, built on first use
ENV_BUILD_PROCESS = "VLLM_LORA_EXT_BUILD_PROCESS"  # 0: background builds run in a thread of the worker
ENV_BUILD_DIR = "VLLM_LORA_EXT_BUILD_DIR"  # where a build process puts its shared file (default /dev/shm)
ENV_STAGE_BYTES = "VLLM_LORA_EXT_STAGE_GPU_BYTES"
ENV_BUILD_SPARE = "VLLM_LORA_EXT_BUILD_SPARE_BYTES"  # a build process's ready shared file (0: none)
ENV_KERNEL_CONFIGS = "VLLM_LORA_EXT_KERNEL_CONFIGS"  # 0: vLLM's own LoRA kernel configs (dense, fused MoE) and kernels
ENV_HOST_ARENAS = "VLLM_LORA_EXT_HOST_ARENAS"  # 0: built tensors in ordinary torch memory (no huge pages, no pinning)
ENV_HOST_ARENA_MIN = "VLLM_LORA_EXT_HOST_ARENA_MIN_BYTES"  # smaller builds use ordinary memory
ENV_HOST_SPARE = "VLLM_LORA_EXT_HOST_SPARE_BYTES"  # the largest released host arena kept for the next (0: none)
ENV_MIX_ON_GPU = "VLLM_LORA_EXT_MIX_ON_GPU"  # 0: a mix loaded in the engine step is concatenated on the CPU
ENV_TRANSPOSE_ON_GPU = "VLLM_LORA_EXT_TRANSPOSE_ON_GPU"  # 0: a fused 3D B is transposed on the CPU
ENV_MIX_THREADS = "VLLM_LORA_EXT_MIX_THREADS"  # threads a CPU concatenation of a mix uses (default: up to 4)
ENV_STALL_TRACE = "VLLM_LORA_EXT_STALL_TRACE_S"  # a diagnostic: log the main thread's stack when it stalls
# Ray Serve LLM: source prefixes (hf:acme/) that clients may name in model="<base>:<source>"; unset: none.
ENV_CLIENT_SOURCES = "VLLM_LORA_EXT_CLIENT_SOURCES"
ENV_MAX_CLIENT_SOURCES = "VLLM_LORA_EXT_MAX_CLIENT_SOURCES"

# The one weight rule (server, offline helper, deployment config, CLI): finite and |w| <= this bound.
# A LoRA delta scaled by more than 100 is far outside anything trained; larger values are a typo or an
# attack (1e308 overflows bf16 to inf).
MAX_ABS_MIX_WEIGHT = 100.0
MAX_MIX_COMPONENTS = 16  # a mix of more adapters is refused before anything is loaded (each costs a load)
# Size caps on files that are read whole.
MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json and a deployment config
MAX_PATTERN_KEY_CHARS = 1024  # a rank_pattern / alpha_pattern key (a module name or a regex)
PATTERN_MATCH_TIMEOUT_S = 0.05  # one pattern key against one module name (config.py)
MAX_PATTERN_KEYS, PATTERN_LOOKUP_CPU_S = 4096, 0.5  # both patterns' keys; CPU s their regexes get per module
MAX_EXPERTS = 1 << 16  # an expert index beyond this is refused before it sizes any work
MAX_STATE_FILE_BYTES = 16 << 20  # the disk tier's ledger or a holds file larger than this is not ours: not read
MAX_LISTING_BYTES = 4 << 20  # a Hub repo's file listing (for a not-found message only): a larger answer lists nothing
MAX_MODEL_FIELD_CHARS = 4096  # the longest 'model' field a request may send, and adapter part of a Ray multiplexed id
MAX_MESSAGE_CHARS = 2000  # an error message passed on whole (a CLI error line, a build failure) is cut here
# GPU memory a worker leaves free for the engine's own allocations when it stages or transposes on the GPU.
GPU_HEADROOM_BYTES = 512 << 20
# The lora_path prefix of a build-ahead probe: the server asks each worker, through add_lora, to build the adapter
# behind it in the background (the probe is answered True once built, and never registered). Clients cannot send it.
PREBUILD_PREFIX = "vllm-lora-ext-prebuild:"

# Mix names: the prefix is reserved; --lora-modules, /v1/load_lora_adapter and deployment configs cannot take it.
MIX_NAME_PREFIX = "mix-"

SourceKind = Literal["hf", "local"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def _env_on(name: str) -> bool:
    """A switch that is on unless set to 0/false/no/off."""
    return os.environ.get(name, "1").strip().lower() not in _FALSE


def _env_list(name: str) -> list[str]:
    """A comma-separated setting's items, stripped, empty ones left out (unset: none)."""
    return [part.strip() for part in os.environ.get(name, "").split(",") if part.strip()]


def allow_unsupported_vllm() -> bool:
    """Return whether the user asked to run on an untested vLLM version anyway."""
    return _env_flag(ENV_ALLOW_UNSUPPORTED_VLLM)


def allow_pickle() -> bool:
    """Return whether pickle weight files (.bin/.pt) may be read (with ``weights_only=True``)."""
    return _env_flag(ENV_ALLOW_PICKLE)


def plugin_disabled() -> bool:
    """Return whether the plugin was switched off for this process."""
    return _env_flag(ENV_DISABLE)


def kernel_configs_enabled() -> bool:
    """Whether LoRA kernels may read the package's tuned configs, and small fused-MoE LoRA batches its pair kernels."""
    return _env_on(ENV_KERNEL_CONFIGS)


def mix_on_gpu() -> bool:
    """Return whether a mix loaded in the engine step is concatenated on the worker's GPU (``VLLM_LORA_EXT_MIX_ON_GPU``,
    default on; 0 turns it off): faster than the CPU build into the kept host arena, so a new mix's first token
    comes sooner (``bench/bench_new_mix.py --mix-on-gpu both``). A mix that does not
    fit the GPU's free memory or the staging budget is built on the CPU. Background builds use the GPU either way."""
    return _env_on(ENV_MIX_ON_GPU)


def mix_threads() -> int | None:
    """Return the threads a mix's CPU concatenation uses (``VLLM_LORA_EXT_MIX_THREADS``; unset: ``None``, up to 4,
    at most the host's cores); at most 64."""
    n = int(_env_number(ENV_MIX_THREADS, 0, minimum=0))
    return min(n, 64) or None


def allow_unmatched_keys() -> bool:
    """Return whether keys that map to no module are only warned about instead of refused."""
    return _env_flag(ENV_ALLOW_UNMATCHED)


def hf_offline() -> bool:
    """Return whether huggingface_hub must not touch the network (``HF_HUB_OFFLINE``)."""
    return _env_flag("HF_HUB_OFFLINE")


def log_level() -> str:
    """Return the plugin's log level name (default INFO)."""
    return os.environ.get(ENV_LOG_LEVEL, "INFO").strip().upper() or "INFO"


def _env_number(name: str, default: float, *, minimum: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a number; unset it or give a number >= {minimum:g}.") from None
    if not value >= minimum or value != value or value == float("inf"):
        raise SettingsError(f"{name}={raw!r} must be a finite number >= {minimum:g}.")
    return value


def _env_size(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    return parse_size(raw, name=name) if raw else default


def max_mixes(default: int) -> int:
    """Return the bound of the server's mix registry (``VLLM_LORA_EXT_MAX_MIXES``, else ``default``)."""
    return int(_env_number(ENV_MAX_MIXES, default, minimum=1))


def mix_wait_seconds() -> float:
    """Return how long a request waits for a free mix slot before a 503 (``VLLM_LORA_EXT_MIX_WAIT_S``, default 60)."""
    return _env_number(ENV_MIX_WAIT, 60.0, minimum=0)


def allowed_roots() -> tuple[str, ...] | None:
    """Return the local folders runtime-loaded sources may read (``VLLM_LORA_EXT_ALLOWED_ROOTS``), or ``None`` (any)."""
    raw = os.environ.get(ENV_ALLOWED_ROOTS, "").strip()
    if not raw:
        return None
    return tuple(os.path.realpath(os.path.expanduser(p)) for p in raw.split(os.pathsep) if p.strip())


def client_sources() -> tuple[str, ...]:
    """Return the source prefixes clients may name directly (``VLLM_LORA_EXT_CLIENT_SOURCES``, comma-separated).

    Unset or empty: clients name only the adapters the operator registered, and mixes of them.
    """
    return tuple(_env_list(ENV_CLIENT_SOURCES))


def max_client_sources() -> int:
    """Return how many client-named sources one Ray Serve replica keeps registered (default 64; LRU beyond)."""
    return int(_env_number(ENV_MAX_CLIENT_SOURCES, 64, minimum=1))


def deployment_config_path() -> str | None:
    """Return the path of the deployment config file, if one is set."""
    value = os.environ.get(ENV_CONFIG, "").strip()
    return value or None


def prebuild_enabled() -> bool:
    """Return whether adapters are built off the engine loop (``VLLM_LORA_EXT_PREBUILD``, default on)."""
    return _env_on(ENV_PREBUILD)


def build_at_start() -> bool:
    """Return whether the deployment config's adapters are built at start (``VLLM_LORA_EXT_BUILD_AT_START``,
    default on); off, they are checked then and each is built by its first request (`integration.startup`)."""
    return _env_on(ENV_BUILD_AT_START)


def prebuild_builds() -> int:
    """Return how many adapters a worker builds at once in the background (default 2)."""
    return int(_env_number(ENV_PREBUILD_BUILDS, 2, minimum=1))


def prebuild_bytes() -> int:
    """Return the CPU memory a worker may hold in built, not yet used adapters (default 8 GiB)."""
    return _env_size(ENV_PREBUILD_BYTES, 8 * 2**30)


def prebuild_wait_seconds() -> float:
    """Return how long a request waits for its adapter's background build (default 600 s)."""
    return _env_number(ENV_PREBUILD_WAIT, 600.0, minimum=0)


def host_arenas_enabled() -> bool:
    """Return whether builds put their tensors in huge-page host arenas, pinned in place on a GPU worker
    (``VLLM_LORA_EXT_HOST_ARENAS``, default on)."""
    return _env_on(ENV_HOST_ARENAS)


def host_arena_min_bytes() -> int:
    """Return the smallest build that gets a host arena (``VLLM_LORA_EXT_HOST_ARENA_MIN_BYTES``, default 4 MiB):
    an arena takes whole 2 MiB pages, and a small build gains little from one pinning call."""
    return _env_size(ENV_HOST_ARENA_MIN, 4 * 2**20)


def transpose_on_gpu() -> bool:
    """Return whether a worker's read of a fused 3D MoE adapter transposes and scales its B factors on the worker's GPU
    (``VLLM_LORA_EXT_TRANSPOSE_ON_GPU``, default on, and a build process leaves them for it to turn once staged;
    0 turns both off): the same tensors, bit for bit, without the CPU's strided pass over them."""
    return _env_on(ENV_TRANSPOSE_ON_GPU)


def host_spare_bytes() -> int:
    """Return the largest host arena whose memory is kept, once released or prepared, for the next arena of about its
    size (``VLLM_LORA_EXT_HOST_SPARE_BYTES``, default 1 GiB; 0: none). One such mapping is kept at a time."""
    return _env_size(ENV_HOST_SPARE, 2**30)


def build_process_enabled() -> bool:
    """Return whether background builds run in a separate build process (``VLLM_LORA_EXT_BUILD_PROCESS``, default on)."""
    return _env_on(ENV_BUILD_PROCESS)


def stage_gpu_bytes() -> int:
    """Return the GPU memory a worker may hold in built adapters staged for their slot copy (default 8 GiB; 0: off)."""
    return _env_size(ENV_STAGE_BYTES, 8 * 2**30)


def stall_trace_seconds() -> float:
    """Return the stall-trace threshold in seconds (``VLLM_LORA_EXT_STALL_TRACE_S``; 0, the default, is off)."""
    return float(_env_number(ENV_STALL_TRACE, 0.0, minimum=0.0))


def build_spare_bytes() -> int:
    """Return the spare shared file a build process keeps ready (default 2 GiB, growing to twice that; 0: none)."""
    return _env_size(ENV_BUILD_SPARE, 2 * 2**30)


# Module groups vLLM accepts a LoRA for and never applies on some models (unapplied.RULES: kv_b_proj under MLA,
# experts under a quantized MoE kernel that ignores LoRA). Set, the adapter is served without them, with a warning.
ENV_DROP_UNAPPLIED = "VLLM_LORA_EXT_DROP_UNAPPLIED"
# The groups unapplied.RULES names (tests/core/test_unapplied.py keeps the two equal).
_DROP_GROUPS = frozenset({"kv_b_proj", "shared_expert_gate", "experts"})


def drop_unapplied() -> frozenset[str]:
    """Return the module groups whose never-applied LoRA weights are dropped with a warning instead of refused
    (``VLLM_LORA_EXT_DROP_UNAPPLIED``, a comma-separated list such as ``kv_b_proj``; unset, the default: none)."""
    return frozenset(_env_list(ENV_DROP_UNAPPLIED))


# ----------------------------------------------------------------------------------------------------- disk tier
ENV_DISK_CACHE_BYTES = "VLLM_LORA_EXT_DISK_CACHE_BYTES"
# The deadline of each file of an adapter's fetch from the Hub (hubdeadline.py): this many bytes a second after a
# grace time from the Hub's first answer for it.
ENV_DOWNLOAD_MIN_RATE = "VLLM_LORA_EXT_DOWNLOAD_MIN_RATE"
ENV_DOWNLOAD_GRACE = "VLLM_LORA_EXT_DOWNLOAD_GRACE_S"


def download_min_rate() -> float:
    """Return the bytes per second each file of an adapter's fetch from the Hub must average after its grace time
    (``VLLM_LORA_EXT_DOWNLOAD_MIN_RATE``, default 1048576, 1 MiB/s; 0: no deadline)."""
    return _env_number(ENV_DOWNLOAD_MIN_RATE, float(1 << 20), minimum=0)


def download_grace_seconds() -> float:
    """Return the seconds each file of an adapter's fetch from the Hub may take beyond its bytes at the minimum rate
    (``VLLM_LORA_EXT_DOWNLOAD_GRACE_S``, default 60)."""
    return _env_number(ENV_DOWNLOAD_GRACE, 60.0, minimum=0)


def disk_cache_bytes() -> int | None:
    """Return the bound on the bytes of adapter revisions the plugin downloaded into the HF cache
    (``VLLM_LORA_EXT_DISK_CACHE_BYTES``, e.g. ``20GiB``); unset or 0: no bound (the default)."""
    raw = os.environ.get(ENV_DISK_CACHE_BYTES, "").strip()
    return (parse_size(raw, name=ENV_DISK_CACHE_BYTES) or None) if raw else None


# The fused-MoE LoRA kernels compiled at start-up (integration/warmup.py): 0 turns it off; the token counts it runs.
ENV_MOE_WARMUP = "VLLM_LORA_EXT_MOE_WARMUP"
ENV_MOE_WARMUP_TOKENS = "VLLM_LORA_EXT_MOE_WARMUP_TOKENS"


def moe_warmup_enabled() -> bool:
    """Return whether an engine with MoE LoRA layers compiles their kernels before it reports ready
    (``VLLM_LORA_EXT_MOE_WARMUP``, default on)."""
    return _env_on(ENV_MOE_WARMUP)


def moe_warmup_tokens() -> list[int] | None:
    """Return the batch token counts the MoE LoRA warm-up runs (``VLLM_LORA_EXT_MOE_WARMUP_TOKENS``, comma-separated
    positive integers; unset: ``None``, the default sweep).

    Raises:
        [`SettingsError`]: the value is not a comma-separated list of positive integers.
    """
    raw = os.environ.get(ENV_MOE_WARMUP_TOKENS, "").strip()
    if not raw:
        return None
    parts = [p.strip() for p in raw.split(",") if p.strip()]
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SettingsError(f"{ENV_MOE_WARMUP_TOKENS}={clip(raw)!r} is not a comma-separated list of positive token "
                         f"counts. Set it like '1,2,4,32,48', or unset it for the default sweep.")
    return sorted({int(p) for p in parts})


_FLAGS = (ENV_ALLOW_UNSUPPORTED_VLLM, ENV_ALLOW_PICKLE, ENV_DISABLE, ENV_ALLOW_UNMATCHED, ENV_PREBUILD,
          ENV_BUILD_PROCESS, ENV_KERNEL_CONFIGS, ENV_HOST_ARENAS, ENV_MIX_ON_GPU,
          ENV_TRANSPOSE_ON_GPU, ENV_MOE_WARMUP, ENV_BUILD_AT_START)
ENV_COMPONENT_CACHE = "VLLM_LORA_EXT_COMPONENT_CACHE"  # read by component_cache_size (below); checked here
_WHOLE = (ENV_MAX_MIXES, ENV_MAX_CLIENT_SOURCES, ENV_PREBUILD_BUILDS, ENV_MIX_THREADS, ENV_COMPONENT_CACHE)
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL")


def check_settings() -> None:
    """Parse every ``VLLM_LORA_EXT_*`` setting now and refuse bad ones, all named in one error.

    Called once at start-up (the plugin's ``register()``), so a typo stops the server at once rather than
    failing a background build or a request later; so does a name a letter or two off a setting's (any other
    ``VLLM_LORA_EXT_*`` name that is no setting is logged as a warning), and an ``HF_ENDPOINT`` that stops
    huggingface_hub. ``VLLM_LORA_EXT_BUILD_DIR`` is not refused here: a folder that cannot be used makes builds run
    in the worker, with a warning that names it.

    Raises:
        [`SettingsError`]: settings malformed or unknown; the message names each, its value and the fix.
    """
    problems: list[str] = []
    for accessor in (functools.partial(max_mixes, 0), mix_wait_seconds, max_client_sources, prebuild_builds,
                     prebuild_bytes, prebuild_wait_seconds, host_arena_min_bytes, host_spare_bytes, stage_gpu_bytes,
                     stall_trace_seconds, build_spare_bytes, mix_threads, disk_cache_bytes, moe_warmup_tokens,
                     download_min_rate, download_grace_seconds,
                     functools.partial(_env_number, ENV_COMPONENT_CACHE, 8, minimum=0)):
        try:
            accessor()
        except SettingsError as err:
            problems.append(str(err))
    for name in _WHOLE:
        raw = os.environ.get(name, "").strip()
        if raw and not raw.lstrip("+").isdigit():
            try:
                _env_number(name, 0, minimum=0)
            except SettingsError:
                continue  # not a number at all: named by its accessor (above) or below
            problems.append(f"{name}={raw[:80]!r} must be a whole number, e.g. 8.")
    if not build_at_start() and not prebuild_enabled():
        problems.append(f"{ENV_BUILD_AT_START}=0 needs background builds, which {ENV_PREBUILD}=0 turns off. Unset one.")
    for name in _FLAGS:
        raw = os.environ.get(name, "").strip().lower()
        if raw and raw not in _TRUE | _FALSE:
            problems.append(f"{name}={os.environ[name][:80]!r} is not a switch; give 1/true/yes/on or 0/false/no/off.")
    if log_level() not in _LOG_LEVELS:
        problems.append(f"{ENV_LOG_LEVEL}={os.environ.get(ENV_LOG_LEVEL, '')[:80]!r} is not a log level; give one of "
                        f"{', '.join(_LOG_LEVELS[:3] + _LOG_LEVELS[4:])}.")
    unknown = drop_unapplied() - _DROP_GROUPS
    if unknown:
        problems.append(f"{ENV_DROP_UNAPPLIED}={os.environ.get(ENV_DROP_UNAPPLIED, '')[:80]!r} names "
                        f"{sorted(unknown)}; give a comma-separated list of {sorted(_DROP_GROUPS)}, or unset it.")
    problems.extend(filter(None, [endpoint_unreadable(os.environ.get("HF_ENDPOINT", ""))]))
    config = deployment_config_path()
    if config is not None:
        problem = not_a_regular_file(config)
        if problem:
            problems.append(f"{ENV_CONFIG}={clip(config)!r} {problem}; point it at a .json or .yaml file.")
    known = [v[len(SETTING_PREFIX):] for k, v in globals().items() if k.startswith("ENV_") and isinstance(v, str)]
    for name in sorted(n for n in os.environ if n.upper().startswith(SETTING_PREFIX) and n[len(SETTING_PREFIX):] not in known):
        near = difflib.get_close_matches(name[len(SETTING_PREFIX):].upper(), known, n=1, cutoff=0.75)
        if near:  # a misspelt setting would do nothing (ALLOWED_ROOT for ALLOWED_ROOTS: runtime sources unconfined)
            problems.append(f"{clip(name)} is not a setting of vllm_lora_ext; did you mean {SETTING_PREFIX}{near[0]}?")
        else:  # an old or foreign name: said, not fatal
            logger.warning("%s is not a setting of vllm_lora_ext and has no effect; unset it (README: Environment "
                           "variables).", clip(name))
    if problems:
        raise SettingsError("Bad settings: " + " ".join(problems))


# -------------------------------------------------------------------- settings of other programs, read here too
PROMETHEUS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's (and vLLM's) multiprocess metrics folder
VLLM_TUNED_CONFIG_FOLDER_ENV = "VLLM_TUNED_CONFIG_FOLDER"  # vLLM's own LoRA kernel configs: then ours stay out


def build_dir() -> str | None:
    """Return the folder a build process puts its shared files in (``VLLM_LORA_EXT_BUILD_DIR``), or ``None``."""
    return os.environ.get(ENV_BUILD_DIR) or None


def component_cache_size() -> int:
    """Return how many mix components one worker keeps built (``VLLM_LORA_EXT_COMPONENT_CACHE``, default 8; a value
    that is not a whole number also gives 8: `check_settings` names it at start-up)."""
    try:
        return max(0, int(os.environ.get(ENV_COMPONENT_CACHE, "8")))
    except ValueError:
        return 8


def metrics_dir_setting() -> str | None:
    """Return the metrics folder this process was given: ``PROMETHEUS_MULTIPROC_DIR``, else
    ``VLLM_LORA_EXT_METRICS_DIR`` (set by the plugin for the processes vLLM starts), else ``None``."""
    return os.environ.get(PROMETHEUS_DIR_ENV) or os.environ.get(ENV_METRICS_DIR) or None


def prometheus_dir_set() -> bool:
    return bool(os.environ.get(PROMETHEUS_DIR_ENV))  # set: vLLM's collector reads that folder


def export_metrics_dir(path: str | None, *, only_if: str | None = None) -> None:
    """Set ``VLLM_LORA_EXT_METRICS_DIR`` to ``path`` for the processes this one starts, or remove it (``None``);
    with ``only_if``, only while it still names that folder."""
    if path is not None:
        os.environ[ENV_METRICS_DIR] = path
    elif only_if is None or os.environ.get(ENV_METRICS_DIR) == only_if:
        os.environ.pop(ENV_METRICS_DIR, None)


def vllm_tuned_config_folder_set() -> bool:
    return VLLM_TUNED_CONFIG_FOLDER_ENV in os.environ  # set: vLLM's own LoRA kernel configs answer


def cuda_visible_devices() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")  # as set (None: unset)


def proxy_configured() -> bool:
    """Return whether an HTTP(S) proxy is set (``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY``, any case)."""
    return any(os.environ.get(v) for n in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY") for v in (n, n.lower()))
