"""Loggers for modules that must not import vLLM: children of vLLM's ``vllm`` logger.

Inside a vLLM process they inherit vLLM's handlers and level (so their lines land in the
engine's log like vLLM's own); elsewhere they behave as plain stdlib loggers.
"""

import logging


def get_logger(module: str) -> logging.Logger:
    return logging.getLogger("vllm.kvshare." + module.removeprefix("kvshare_connector."))
