"""Shared fixtures: vLLM's real KV objects for Gemma-4 shaped models, built once per session."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def cpu_stack(model: str, layout: str, kv_mib: int = 64):
    """Cached ``build_cpu_stack`` (vLLM import and model build cost seconds)."""
    from kvshare_connector.devtools.cpu_stack import build_cpu_stack

    return build_cpu_stack(model, layout, kv_bytes=kv_mib << 20)


@functools.cache
def cpu_topology(model: str, layout: str, kv_mib: int = 64):
    from kvshare_connector.devtools.cpu_stack import topology_of

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
