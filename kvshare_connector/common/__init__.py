"""Helpers every layer may use: vLLM-child loggers (``log``), atomic file writes (``files``)
and child processes with drained output (``child_process``)."""
