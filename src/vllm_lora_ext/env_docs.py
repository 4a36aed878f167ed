"""The README's environment-variable table, one row per setting: ``{variable: (the setting shown, its effect)}``.

``python -m vllm_lora_ext.cli.readme`` renders it into README.md; ``tests/core/test_readme.py`` fails for a
``constants.ENV_*`` name without a row here.
"""

from __future__ import annotations

from vllm_lora_ext.constants import (  # noqa: F401 (the names the table documents)
    ENV_ALLOWED_ROOTS,
    ENV_ALLOW_PICKLE,
    ENV_ALLOW_UNMATCHED,
    ENV_ALLOW_UNSUPPORTED_VLLM,
    ENV_BUILD_AT_START,
    ENV_BUILD_DIR,
    ENV_BUILD_PROCESS,
    ENV_BUILD_SPARE,
    ENV_CLIENT_SOURCES,
    ENV_COMPONENT_CACHE,
    ENV_CONFIG,
    ENV_DISABLE,
    ENV_DISK_CACHE_BYTES,
    ENV_DOWNLOAD_GRACE,
    ENV_DOWNLOAD_MIN_RATE,
    ENV_DROP_UNAPPLIED,
    ENV_HOST_ARENAS,
    ENV_HOST_ARENA_MIN,
    ENV_HOST_SPARE,
    ENV_KERNEL_CONFIGS,
    ENV_LOG_LEVEL,
    ENV_MAX_CLIENT_SOURCES,
    ENV_MAX_MIXES,
    ENV_METRICS_DIR,
    ENV_MIX_ON_GPU,
    ENV_MIX_THREADS,
    ENV_MIX_WAIT,
    ENV_MOE_WARMUP,
    ENV_MOE_WARMUP_TOKENS,
    ENV_PREBUILD,
    ENV_PREBUILD_BUILDS,
    ENV_PREBUILD_BYTES,
    ENV_PREBUILD_WAIT,
    ENV_STAGE_BYTES,
    ENV_STALL_TRACE,
    ENV_TRANSPOSE_ON_GPU,
)

ENV_DOCS: dict[str, tuple[str, str]] = {
    ENV_CONFIG: ("", "deployment config file (JSON/YAML) registered at `vllm serve` start-up"),
    ENV_ALLOW_PICKLE: ("=1", "accept `.bin`/`.pt` weights (read with `weights_only=True`)"),
    ENV_ALLOW_UNMATCHED: ("=1", "warn instead of refusing keys that match no module"),
    ENV_ALLOW_UNSUPPORTED_VLLM: ("=1", "run on an untested vLLM version"),
    ENV_DISABLE: ("=1", "keep the plugin installed but inert (stock vLLM behaviour)"),
    ENV_COMPONENT_CACHE: ("", "mix components cached per worker (default 8)"),
    ENV_MAX_MIXES: ("", "mixes one API server keeps registered (default `--max-cpu-loras`)"),
    ENV_MIX_WAIT: ("", "how long a new mix waits for a free registry slot before a 503 (default 60)"),
    ENV_ALLOWED_ROOTS: ("", "`os.pathsep`-separated folders runtime-loaded local sources must lie in (default: any)"),
    ENV_LOG_LEVEL: ("", "the plugin's log level (default INFO)"),
    ENV_BUILD_AT_START: ("=0", "check the deployment config's adapters at start and build each on its first request "
                              "(default: built at start); Ray Serve LLM replicas with residency routing set it"),
    ENV_PREBUILD: ("=0", "build adapters inside the engine step, as stock vLLM does (default: in the background)"),
    ENV_PREBUILD_BUILDS: ("", "background builds one worker runs at once (default 2)"),
    ENV_PREBUILD_BYTES: ("", "CPU memory a worker may hold in built, not yet used adapters (default 8 GiB)"),
    ENV_PREBUILD_WAIT: ("", "how long a request waits for its adapter's build before the engine builds it itself "
                            "(default 600)"),
    ENV_BUILD_PROCESS: ("=0", "run background builds in a worker thread instead of a build process"),
    ENV_BUILD_DIR: ("", "where build processes put the shared files they hand over (default `/dev/shm` if it has "
                        "room, else the temp dir)"),
    ENV_STAGE_BYTES: ("", "GPU memory a worker may use for built adapters waiting for their slot copy (default 8 "
                          "GiB; 0: never stage)"),
    ENV_TRANSPOSE_ON_GPU: ("=0", "transpose a fused 3D adapter's B factors on the CPU when the worker loads it "
                                 "(default: on the worker's GPU, the same bytes; a 48-layer 3D build"
                                 " takes about half the time; a build process leaves them for the GPU)"),
    ENV_MIX_ON_GPU: ("=0", "concatenate a mix loaded in the engine step on the CPU (default: on the worker's GPU,"
                           " as background builds do, where it fits; 11-24 ms against 59-79 ms on the CPU for"
                           " four 7B r16 components)"),
    ENV_HOST_ARENAS: ("=0", "build adapters and mixes in ordinary torch memory (default: one huge-page host arena"
                            " per build, pinned in place on a GPU worker; see \"Host memory\")"),
    ENV_HOST_ARENA_MIN: ("", "smallest build that gets a host arena (default 4 MiB)"),
    ENV_HOST_SPARE: ("", "largest host arena kept ready (touched, pinned) for the next mix of its size (default 1"
                         " GiB; 0: none)"),
    ENV_MIX_THREADS: ("", "threads a mix's CPU concatenation uses (default: up to 4, at most the host's cores)"),
    ENV_BUILD_SPARE: ("", "smallest spare shared file (pages taken ahead) a build process keeps ready (default 2 "
                          "GiB; 0: none)"),
    ENV_KERNEL_CONFIGS: ("=0", "vLLM's own LoRA shrink/expand and fused-MoE LoRA kernel configs, and its own kernel "
                               "for small fused-MoE LoRA batches (default: the tuned tables shipped for this GPU and "
                               "the plugin's pair kernels, see \"Tuned LoRA kernels\")"),
    ENV_STALL_TRACE: ("", "a diagnostic: log a process's main-thread stack when one call stays on top longer than"
                          " this, and profile a worker's adapter registration in the step when it takes longer"
                          " (default 0: off)"),
    ENV_CLIENT_SOURCES: ("", "Ray Serve LLM: comma-separated source prefixes (`hf:acme/`, `/srv/loras/`) clients may "
                             "name in `model=\"<id>:<source>\"`, compared after resolving `.`, `..`, `//` and "
                             "symlinks (default: none)"),
    ENV_MAX_CLIENT_SOURCES: ("", "Ray Serve LLM: client-named sources one replica keeps registered, least "
                                 "recently used dropped first (default 64)"),
    ENV_METRICS_DIR: ("", "set by the plugin for the vLLM processes it starts: where they write the plugin's "
                          "metrics files (default: a private folder, or `PROMETHEUS_MULTIPROC_DIR` when set); not"
                          " a setting"),
    ENV_DROP_UNAPPLIED: ("", "comma-separated module groups (`kv_b_proj`, `shared_expert_gate`, `experts`) that vLLM would "
                             "not apply as trained on this model: drop them with a warning instead of refusing the "
                             "adapter (default: refuse; see \"Modules vLLM would accept and not apply as trained\")"),
    ENV_DISK_CACHE_BYTES: ("", "bound on the adapter revisions the plugin downloaded into the HF cache, e.g. `20GiB` "
                               "or `20GB` (default, or `0`: no bound); see \"Disk cache\""),
    ENV_DOWNLOAD_MIN_RATE: ("", "bytes per second each file of an adapter's download from the Hub must average "
                                "after its grace time, or it is stopped with `HubTooSlowError` (default 1048576, "
                                "1 MiB/s; 0: no deadline); a Hub that trickles bytes would otherwise hold the request "
                                "for ever"),
    ENV_DOWNLOAD_GRACE: ("", f"seconds each file of an adapter's download may take, from the Hub's first answer, "
                             f"beyond its bytes at `{ENV_DOWNLOAD_MIN_RATE}` (default 60)"),
    ENV_MOE_WARMUP: ("=0", "skip compiling the LoRA Triton kernels at engine start (default: with LoRA on and MoE "
                           "LoRA layers, dummy LoRA batches over the decode and prefill sizes, their logits included, "
                           "run before the engine reports ready, so no request compiles them in its step; "
                           "`Worker.compile_or_warm_up_model` in `integration/PATCHES.md`)"),
    ENV_MOE_WARMUP_TOKENS: ("", "comma-separated batch token counts that warm-up runs (default: 1 to `max_num_seqs` "
                                "or 64, then 2^k and 3·2^(k-1), each plus 0, 1, 15, 16 and 17, up to "
                                "`max_num_batched_tokens`, and a count for each kernel variant of the model's shape "
                                "those miss; naming counts runs those alone)"),
}
