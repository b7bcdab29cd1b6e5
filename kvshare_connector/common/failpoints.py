"""Failpoints: named points in the data path where a test makes a process pause, fail or
die, so that a fault lands exactly where it hurts (between a READ's post and its
completion, after a claim is answered, ...) instead of wherever a wall-clock kill falls.

Off unless ``KVSHARE_FAILPOINTS`` names some when the process starts (or a test calls
``configure``); off, a point costs one global truth test. The variable holds
``name=action`` items separated by ``;``, an action being::

    fail            raise FailpointError at the point (the caller's error path runs)
    pause:SECONDS   sleep there (a hung peer, a slow step)
    exit            os._exit(137) at once (a crash: no cleanup, like SIGKILL)

optionally followed by ``*N``: fire on N hits only, and by ``@K``: let the first K hits
pass (a live server's warm-up), so ``exit@40`` kills the process at the 41st hit. E.g.
``KVSHARE_FAILPOINTS="sink.read_posted=exit;source.claim_answered=pause:20*1@40"``.
Every point is listed in ``POINTS`` with where it sits.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from kvshare_connector.common.log import get_logger

logger = get_logger(__name__)

ENV = "KVSHARE_FAILPOINTS"
POINTS = {
    "peers.handshake": "decode, before it asks a prefill for its handshake",
    "source.claim_answered": "prefill, a claim's reply built (blocks held for the reader)",
    "sink.read_posted": "decode, a READ handed to NIXL, before it is seen done",
    "sink.before_scatter": "decode, a packed READ landed in staging, before the scatter",
    "sink.before_report": "decode, a load done (and verified), before the engine learns",
    "source.before_release": "prefill, decode said done, before the blocks are freed",
    "proxy.before_decode": "our proxy, prefill answered, before the decode leg (fail: the "
    "decode never comes; prefill's lease must free the blocks it holds)",
}
EXIT_CODE = 137


class FailpointError(RuntimeError):
    """Raised by a point set to ``fail``."""


@dataclass
class _Point:
    action: str  # fail | pause | exit
    seconds: float = 0.0
    left: int | None = None  # hits that still fire (None: every hit)
    skip: int = 0  # hits that still pass before it fires


_ACTIVE: dict[str, _Point] = {}
_lock = threading.Lock()


def parse(spec: str) -> dict[str, _Point]:
    """``name=action[:arg][*count][@skip]`` items; ``ValueError`` naming what is wrong."""
    points: dict[str, _Point] = {}
    for item in filter(None, (i.strip() for i in spec.split(";"))):
        name, sep, action = item.partition("=")
        if not sep or name not in POINTS:
            raise ValueError(f"{ENV}: {item!r}: expected NAME=ACTION, NAME one of {sorted(POINTS)}")
        action, at, skip = action.partition("@")
        if at and not skip.isdigit():
            raise ValueError(f"{ENV}: {item!r}: @ wants the number of hits to let pass")
        action, _, count = action.partition("*")
        kind, _, arg = action.partition(":")
        if kind not in ("fail", "pause", "exit") or (kind == "pause") != bool(arg):
            raise ValueError(f"{ENV}: {item!r}: action must be fail, pause:SECONDS or exit")
        try:
            left = int(count) if count else None
            seconds = float(arg) if kind == "pause" else 0.0
        except ValueError:
            raise ValueError(f"{ENV}: {item!r}: a count or pause that is not a number") from None
        points[name] = _Point(kind, seconds, left, int(skip or 0))
    return points


def configure(spec: str | None) -> None:
    """Arm the points ``spec`` names (None or empty: disarm all)."""
    with _lock:
        _ACTIVE.clear()
        _ACTIVE.update(parse(spec or ""))
    if _ACTIVE:
        logger.warning("failpoints armed: %s", spec)


def failpoint(name: str) -> None:
    """Act if ``name`` is armed; nothing (one truth test) when no point is."""
    if not _ACTIVE:
        return
    with _lock:
        point = _ACTIVE.get(name)
        if point is None or point.left == 0:
            return
        if point.skip > 0:
            point.skip -= 1
            return
        if point.left is not None:
            point.left -= 1
    logger.warning("failpoint %s: %s", name, point.action)
    if point.action == "pause":
        time.sleep(point.seconds)
    elif point.action == "exit":
        os._exit(EXIT_CODE)
    else:
        raise FailpointError(f"failpoint {name} fired")


configure(os.environ.get(ENV))
