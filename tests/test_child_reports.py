"""A child's report lines survive its other threads logging to stdout.

CI, 2026-12-07 (vLLM 0.26): a test peer printed ``RELEASED {...}`` while its side-channel
thread logged through vLLM's logger (a handler on ``sys.stdout``); the record landed between
the line's text and its newline, the parent's reader failed to parse it and lost every later
release. Here a child reports thousands of lines while a thread logs as fast as it can
through such a handler, with the interpreter switching threads every microsecond; every
report must parse. The negative control is the old way (``print``) in the same child: it
must corrupt some lines. The handler is the child's own, not vLLM's: importing vLLM 0.33's
logger does not configure its handler (the record went nowhere), so there the control
corrupted no line in CI, and a control that can pass proves nothing.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvshare_connector.common.child_process import Child, parse_report, report_of

CHILD = r"""
import logging, sys, threading
from kvshare_connector.common.child_process import report

log = logging.getLogger("reports_test")  # a handler on sys.stdout, as vLLM 0.26 configures
handler = logging.StreamHandler(sys.stdout)
handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(filename)s] %(message)s"))
log.addHandler(handler)
log.setLevel(logging.INFO)
sys.setswitchinterval(1e-6)
stop = threading.Event()

def chatter():
    while not stop.is_set():
        log.info("a side-channel thread's log record, as long as real ones are: %s", "x" * 40)

threading.Thread(target=chatter, daemon=True).start()
for i in range(LINES):
    if MODE == "report":
        report("REPORT ", {"i": i, "read": ["req-%d" % i]})
    else:
        print("REPORT " + '{"i": %d, "read": ["req-%d"]}' % (i, i), flush=True)
stop.set()
"""
LINES = 3000


def reports_of(mode: str) -> tuple[list[int], list[str]]:
    """Report indices that parsed, and the report lines that did not."""
    source = CHILD.replace("LINES", str(LINES)).replace("MODE", repr(mode))
    out = subprocess.run(
        [sys.executable, "-c", source], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    parsed, bad = [], []
    for line in out.splitlines(keepends=True):
        if line.startswith("REPORT "):
            try:
                parsed.append(parse_report(line, "REPORT ")["i"])
            except ValueError as exc:
                bad.append(str(exc))
    return parsed, bad


def test_reports_parse_while_another_thread_logs():
    parsed, bad = reports_of("report")
    assert bad == []
    assert parsed == list(range(LINES))


def test_control_print_on_a_shared_stdout_corrupts_lines():
    """A race: here 21 to 343 of 3,000 lines were corrupted a run; up to three runs."""
    for _ in range(3):
        parsed, bad = reports_of("print")
        if bad:
            break
    assert bad, "print on a shared stdout kept every line whole: the test above proves nothing"
    assert "malformed REPORT line" in bad[0]
    assert len(parsed) < LINES


def test_child_reads_reports_on_stdout_and_logs_on_stderr():
    """``Child`` finds a report among the child's logs and keeps both in its log."""
    code = (
        "import sys\n"
        "from kvshare_connector.common.child_process import report\n"
        "print('before the first report', flush=True)\n"
        "report('DONE ', {'ok': 1})\n"
        "print('after it: on stderr now', flush=True)\n"
    )
    child = Child(["-c", code])
    try:
        assert child.wait_json("DONE ", 60) == {"ok": 1}
        child.process.wait(timeout=30)
        deadline = time.monotonic() + 10  # the stderr thread may still be reading
        while "after it: on stderr now\n" not in child.log and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        child.kill()
    assert "after it: on stderr now\n" in child.log
    # after the first report, stdout carries reports only: the print went to stderr
    assert not any(line.startswith("after it") for line in list(child.lines.queue))


def test_a_malformed_report_is_named():
    with pytest.raises(ValueError, match="malformed RELEASED line"):
        parse_report('RELEASED {"read": []}INFO 12-07 a log record\n', "RELEASED ")
    prefixes = ("READY ", "RELEASED ", "ALL_READY ")
    assert report_of("INFO 12-07 a log line before the first report\n", prefixes) is None
    assert report_of('ALL_READY {}\n', prefixes) == ("ALL_READY ", {})
    assert report_of('RELEASED {"read": ["r"]}\n', prefixes) == ("RELEASED ", {"read": ["r"]})
    with pytest.raises(ValueError, match="malformed RELEASED line"):
        report_of('RELEASED {"read": []}INFO 12-07 a log record\n', prefixes)
