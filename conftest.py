"""Process-wide test environment, set before anything imports huggingface_hub.

huggingface_hub reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE once, at import. The tests start a
local server that speaks the Hub's file API and point HF_ENDPOINT at it, so the real client runs
against it and nothing ever reaches the internet. Each test gets its own cache (tests/conftest.py).
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "tests"))

from hubserver import HubServer  # noqa: E402

import hubserver  # noqa: E402

HUB = hubserver.SERVER = HubServer().start()
_HOME = tempfile.mkdtemp(prefix="vllm-lora-ext-hf-")
os.environ.update({
    "HF_ENDPOINT": HUB.url,
    "HF_HOME": _HOME,
    "HF_HUB_OFFLINE": "0",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_XET": "1",
    "HF_HUB_ETAG_TIMEOUT": "5",
    "HF_HUB_DOWNLOAD_TIMEOUT": "5",
    "TOKENIZERS_PARALLELISM": "false",
})
os.environ.pop("HF_TOKEN", None)


# The optional Ray module has no doctests, and importing it needs Ray Serve LLM with the vLLM release it targets;
# tests/integration/test_ray.py tests it where that pair is installed.
collect_ignore = ["src/vllm_lora_ext/integration/ray.py", "src/vllm_lora_ext/integration/ray_routing.py"]
