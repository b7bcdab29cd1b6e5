"""Loggers for modules that must not import vLLM: children of vLLM's ``vllm`` logger.

Inside a vLLM process they inherit vLLM's handlers and level (so their lines land in the
engine's log like vLLM's own); elsewhere they behave as plain stdlib loggers.
"""

import logging
import time


def get_logger(module: str) -> logging.Logger:
    return logging.getLogger("vllm.kvshare." + module.removeprefix("kvshare_connector."))


class LogBudget:
    """At most ``lines`` lines per window (at ``level``, each cut to ``max_chars``, after
    ``subject``); the rest are counted and summed up once the window ends, so that no peer
    and no hot path can make the engine log without bound."""

    def __init__(self, lines: int, window_s: float, level: int = logging.WARNING,
                 subject: str = "side channel", logger: logging.Logger | None = None,
                 max_chars: int = 300) -> None:  # fmt: skip
        self.lines, self.window_s, self.level = lines, window_s, level
        self.subject, self.max_chars = subject, max_chars
        self.logger = logger or get_logger(__name__)
        self._start, self._used, self._suppressed = time.monotonic(), 0, 0

    def log(self, message: str) -> None:
        now = time.monotonic()
        if now - self._start > self.window_s:
            if self._suppressed:
                self.logger.log(self.level, "%s: %d more line(s) like these not logged in the "
                                "last %.0f s", self.subject, self._suppressed, now - self._start,
                                stacklevel=2)  # fmt: skip
            self._start, self._used, self._suppressed = now, 0, 0
        if self._used < self.lines:
            self._used += 1
            self.logger.log(self.level, "%s: %s", self.subject, message[: self.max_chars],
                            stacklevel=2)  # the caller's file and line
        else:
            self._suppressed += 1
