"""The library root logger ``vllm_lora_ext``: one handler, attached once, level from the environment."""

from __future__ import annotations

import logging

from vllm_lora_ext.constants import log_level

ROOT_LOGGER_NAME = "vllm_lora_ext"


def attach_handler_once() -> logging.Logger:
    """Give the package logger one stream handler (only if it has none) and the configured level."""
    logger = logging.getLogger(ROOT_LOGGER_NAME)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    level = logging.getLevelName(log_level())
    logger.setLevel(level if isinstance(level, int) else logging.INFO)
    return logger
