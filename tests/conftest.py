"""Shared fixtures: vLLM's real KV objects for Gemma-4 shaped models, built once per session."""

from __future__ import annotations

import functools
import importlib.metadata
import os

import pytest

# One vLLM cache root per vLLM release, for this process and the peers it starts. vLLM
# caches a model class's inspection under a file name that does not change between
# releases: test runs on 0.26 and 0.33 evict each other's entry, and every process that
# misses re-imports vLLM in a subprocess to inspect Gemma-4 again (10-17 s of CPU each).
# Seen as peers that needed over 300 s to start while both suites ran on one 2-core box.
os.environ.setdefault(
    "VLLM_CACHE_ROOT",
    os.path.join(os.path.expanduser("~"), ".cache", f"vllm-{importlib.metadata.version('vllm')}"),
)

# The lab (lab/tools: engine_sim, kv_probe, attacks...) is imported from the repository
# root, which ``python -m`` puts on the path only when run from there: the peers these
# tests start as scripts, or in another directory, find it through PYTHONPATH.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p
)


@functools.cache
def cpu_stack(model: str, layout: str, kv_mib: int = 64):
    """Cached ``build_cpu_stack`` (vLLM import and model build cost seconds)."""
    from kvshare_connector.demo.cpu_stack import build_cpu_stack

    return build_cpu_stack(model, layout, kv_bytes=kv_mib << 20)


@functools.cache
def cpu_topology(model: str, layout: str, kv_mib: int = 64):
    from kvshare_connector.demo.cpu_stack import topology_of

    stack = cpu_stack(model, layout, kv_mib)
    return stack, topology_of(stack)


@pytest.fixture(scope="session")
def stack_topology():
    return cpu_topology


def _leaked_threads() -> list[str]:
    import threading

    return [
        t.name
        for t in threading.enumerate()
        if t is not threading.main_thread() and not t.daemon and t.is_alive()
    ]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail, naming them, when tests leave non-daemon threads behind: they keep the
    interpreter from exiting (LMCache's storage-manager loop does until its engine is
    destroyed), so a leak would otherwise show up only as a test run that never ends."""
    leaked = _leaked_threads()
    if leaked:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"tests left non-daemon threads running (an engine not shut down?): {leaked}"
        if reporter is not None:
            reporter.write_line(message, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    """After the report: leave even if leaked threads would block the interpreter's exit."""
    if _leaked_threads():
        import os
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(pytest.ExitCode.TESTS_FAILED))


@pytest.fixture(autouse=True)
def _ucx_environment_restored():
    """The lane plan sets UCX_* in its engine's process (``lanes.apply``): here, where
    engines run in the test process, a test leaves that environment as it found it, so the
    peers a later test starts see its own settings, not a neighbour's."""
    before = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    yield
    for key in [k for k in os.environ if k.startswith("UCX_") and k not in before]:
        del os.environ[key]
    os.environ.update(before)
