"""Checks of what the ``kvshare`` command is given, made before it starts anything.

Argument types (argparse ``type=``) refuse malformed values as they are parsed; the other
functions look at the machine: paths, ports, executables, modules, GPUs. All raise
``UsageError`` (argument types: ``argparse.ArgumentTypeError``) with a message naming the
problem; ``cli.main`` prints it as one line, ``kvshare <command>: error: ...``, and exits
with status 2. Nothing here imports torch or vLLM, or touches CUDA.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import json
import math
import os
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

EXIT_USAGE = 2  # argparse's status for bad usage


class UsageError(ValueError):
    """Bad input or a missing prerequisite: one line for the user, exit status 2."""


def one_line(message: object) -> str:
    """``message`` with every run of whitespace (newlines included) made one space."""
    return " ".join(str(message).split())


# ---- numbers --------------------------------------------------------------------------------


def _describe(low: float | None, high: float | None, above: bool, integer: bool) -> str:
    noun = "an integer" if integer else "a number"
    if low is not None and high is not None:
        return f"{noun} in {'(' if above else '['}{low:g}, {high:g}]"
    if low is not None:
        return f"{noun} {'>' if above else '>='} {low:g}"
    if high is not None:
        return f"{noun} <= {high:g}"
    return "a finite integer" if integer else "a finite number"


def in_range(
    value: Any,
    what: str,
    low: float | None = None,
    high: float | None = None,
    *,
    above: bool = False,
    integer: bool = False,
) -> Any:
    """``value`` if it is a finite number (an int with ``integer``) in ``[low, high]``
    (``(low, high]`` with ``above``); a ``UsageError`` naming ``what`` otherwise."""
    ok = isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)
    ok = ok and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if above else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        raise UsageError(f"{what} must be {_describe(low, high, above, integer)}, got {value!r}")
    return value


#: (low, high, low excluded, integer) of a number, for ``check_fields``.
Range = tuple[float | None, float | None, bool, bool]


def check_fields(obj: object, where: str, ranges: dict[str, Range]) -> None:
    """Each attribute of ``obj`` named in ``ranges`` is None or in its range."""
    for key, (low, high, above, integer) in ranges.items():
        if getattr(obj, key) is not None:
            in_range(getattr(obj, key), f"{where}{key}", low, high, above=above, integer=integer)


def number(
    kind: type[int] | type[float],
    low: float | None = None,
    high: float | None = None,
    *,
    above: bool = False,
) -> Callable[[str], Any]:
    """An argparse ``type=`` for ``kind`` values in a range (see ``in_range``)."""
    integer = kind is int
    expected = _describe(low, high, above, integer)

    def parse(text: str) -> Any:
        try:
            return in_range(kind(text), "value", low, high, above=above, integer=integer)
        except ValueError:  # UsageError included
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None

    parse.__name__ = expected
    return parse


positive_int = number(int, 1)
non_negative_int = number(int, 0)
port_number = number(int, 1, 65535)
positive_float = number(float, 0, above=True)
non_negative_float = number(float, 0)
fraction = number(float, 0, 1, above=True)


# ---- strings --------------------------------------------------------------------------------


def http_url(text: str) -> str:
    """An argparse type: an ``http(s)://host[:port][/path]`` URL."""
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(
            f"expected an http(s) URL with a host, e.g. http://127.0.0.1:8100, got {text!r}"
        )
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"URL {text!r}: the port must be in 1-65535")
    if parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(f"URL {text!r}: a server URL has no ?query or #fragment")
    return text.strip()


def json_object(text: str) -> dict[str, Any]:
    """An argparse type: a JSON object (``{...}``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f'expected a JSON object like {{"key": 1}}, got a {type(value).__name__}: {text!r}'
        )
    return value


def shell_words(text: str) -> list[str]:
    """An argparse type: words split as a POSIX shell would."""
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"cannot split {text!r} into words: {exc}") from None


def env_pair(text: str) -> tuple[str, str]:
    """An argparse type: ``KEY=VALUE``."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def gpu_list(text: str) -> list[str]:
    """An argparse type: GPU ids (``0`` or ``0,1``; UUIDs ``GPU-...``/``MIG-...`` too)."""
    gpus = [g.strip() for g in text.split(",") if g.strip()]
    bad = [g for g in gpus if not (g.isdigit() or g.startswith(("GPU-", "MIG-")))]
    if not gpus or bad:
        raise argparse.ArgumentTypeError(f"expected GPU ids like 0 or 0,1, got {text!r}")
    return gpus


# ---- paths ----------------------------------------------------------------------------------


def looks_like_path(model: str) -> bool:
    """A local path rather than a hub id (``org/name``): starts with ``/``, ``.`` or ``~``,
    exists in part (its first component), or has more parts than a hub id can."""
    parts = Path(model).parts
    return (
        model.startswith(("/", ".", "~"))
        or len(parts) > 2
        or (len(parts) > 1 and Path(parts[0]).exists())
        or Path(model).exists()
    )


def check_model(model: str, what: str = "model") -> str:
    """A hub id as given, or a local path (``~`` expanded) that must exist."""
    if not model.strip():
        raise UsageError(f"{what} is empty: give a local path or a hub id like org/name")
    if not looks_like_path(model):
        return model
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise UsageError(
            f"{what} path {model!r} does not exist (a hub model id looks like org/name)"
        )
    return path


def require_file(path: Path, what: str) -> Path:
    if not path.exists():
        raise UsageError(f"{what} {str(path)!r} does not exist")
    if not path.is_file():
        raise UsageError(f"{what} {str(path)!r} is not a file")
    return path


def require_dir(path: Path, what: str) -> Path:
    if not path.is_dir():
        raise UsageError(f"{what} {str(path)!r} is not a directory")
    return path


def check_writable_dir(path: Path, what: str) -> None:
    """``path`` is a directory we can write in, or one we can create."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"{what} {str(path)!r} exists and is not a directory")
    base = path.absolute()
    while not base.exists():
        base = base.parent
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
        raise UsageError(f"{what} {str(path)!r}: cannot create or write in {str(base)!r}")


def check_new_file(path: Path, what: str) -> None:
    """``path`` can be written: its directory exists and is writable, it is no directory."""
    if path.is_dir():
        raise UsageError(f"{what} {str(path)!r} is a directory")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise UsageError(f"{what} {str(path)!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{what} {str(path)!r}: cannot write in {str(parent)!r}")


# ---- executables and modules ----------------------------------------------------------------


def locate(name: str) -> str | None:
    """``name`` beside the running Python (its virtualenv's bin/), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


def require_executable(name: str, hint: str = "") -> str:
    """``locate(name)``, or a ``UsageError`` saying where it looked."""
    found = locate(name)
    if found is None:
        raise UsageError(
            f"`{name}` not found: looked in {str(Path(sys.executable).parent)!r} (beside "
            f"{sys.executable}) and on PATH{'; ' + hint if hint else ''}"
        )
    return found


def require_command(program: str, what: str) -> None:
    """``program`` (a command's first word) runs: an executable file, or found on PATH."""
    if os.sep in program:
        ok = Path(program).is_file() and os.access(program, os.X_OK)
    else:
        ok = shutil.which(program) is not None
    if not ok:
        raise UsageError(f"{what}: {program!r} is not an executable (not found or not on PATH)")


def require_module(names: Sequence[str], hint: str) -> None:
    """One of ``names`` is importable by this Python (found, not imported)."""
    if not any(importlib.util.find_spec(n) is not None for n in names):
        raise UsageError(f"{' or '.join(names)} is not installed for {sys.executable}; {hint}")


def installed_version(dist: str) -> str | None:
    """The version of distribution ``dist`` installed for this Python, or None."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


#: The newest vLLM release each kvcached release adapts: later ones stop at engine start
#: ("kvcached has no runner adapter for vLLM ..."; kvcached 0.1.6's vLLM patches, read from
#: its sdist, and docs/kvcached.md).
KVCACHED_ADAPTS_VLLM_UP_TO = {"0.1.6": (0, 30)}


def check_kvcached() -> None:
    """``ENABLE_KVCACHED=true`` for vLLM engines started from this Python's environment:
    kvcached is installed there (without it the engines run on vLLM's own allocator, with
    no word said) and adapts that vLLM release (else each engine stops at start)."""
    kvcached, vllm = installed_version("kvcached"), installed_version("vllm")
    if kvcached is None:
        raise UsageError(
            f"ENABLE_KVCACHED=true, but kvcached is not installed for {sys.executable}: the "
            "engines would run without it. Install kvcached 0.1.6 (with vLLM <= 0.30), or "
            "leave ENABLE_KVCACHED off"
        )
    up_to = KVCACHED_ADAPTS_VLLM_UP_TO.get(kvcached)
    release = tuple(int(x) for x in (vllm or "").split(".")[:2] if x.isdigit())
    if up_to is not None and len(release) == 2 and release > up_to:
        raise UsageError(
            f"ENABLE_KVCACHED=true, but kvcached {kvcached} adapts vLLM up to "
            f"{up_to[0]}.{up_to[1]} and this is vLLM {vllm}: each engine would stop at start. "
            "Use vLLM 0.26 with kvcached (docs/kvcached.md), or leave ENABLE_KVCACHED off"
        )


# ---- GPUs and ports -------------------------------------------------------------------------


def gpu_count() -> tuple[int, str]:
    """CUDA devices on this host and, when none, why: ``nvidia-smi -L`` if it is on PATH,
    else the ``/dev/nvidiaN`` device files. Neither initialises CUDA here."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        devices = list(Path("/dev").glob("nvidia[0-9]*"))
        return len(devices), "nvidia-smi not found and no /dev/nvidia* device"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 0, f"`nvidia-smi -L` failed: {exc}"
    count = sum(line.startswith("GPU ") for line in out.stdout.splitlines())
    first = (out.stdout + out.stderr).strip().splitlines()[:1]
    return count, f"`nvidia-smi -L` lists none ({first[0] if first else 'no output'})"


def check_gpus(ids: Iterable[str], why: str) -> None:
    """A CUDA device is visible (``CUDA_VISIBLE_DEVICES=""`` hides all) and every numeric id
    of ``ids`` is one of them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        raise UsageError(f"no CUDA device visible: CUDA_VISIBLE_DEVICES is empty; {why}")
    count, reason = gpu_count()
    if count == 0:
        raise UsageError(f"no CUDA device visible: {reason}; {why}")
    missing = sorted({g for g in ids if g.isdigit() and int(g) >= count}, key=int)
    if missing:
        raise UsageError(
            f"GPU {', '.join(missing)} requested, but this host has {count} (0-{count - 1})"
        )


def check_ports(host: str, ports: Sequence[tuple[str, int]], free: bool = True) -> None:
    """Each ``(what, port)`` is in 1-65535 and used once; with ``free``, ``host`` resolves
    and nothing listens on these ports there yet."""
    seen: dict[int, str] = {}
    for what, port in ports:
        in_range(port, what, 1, 65535, integer=True)
        if port in seen:
            raise UsageError(f"{seen[port]} and {what} would both use port {port}")
        seen[port] = what
    if not free or not ports:
        return
    try:
        info = socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise UsageError(f"--host {host!r} does not resolve: {exc}") from None
    family, _, _, _, address = info[0]
    for what, port in ports:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind
            try:
                sock.bind((address[0], port, *address[2:]))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise UsageError(f"{what}: port {port} on {host} is already in use") from None
                raise UsageError(f"{what}: cannot listen on {host}:{port}: {exc}") from None
