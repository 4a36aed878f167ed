"""``python -m vllm_lora_ext.cli``: the same as the ``vllm-lora`` command."""

import sys

from vllm_lora_ext.cli import main

sys.exit(main())
