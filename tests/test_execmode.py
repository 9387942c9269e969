"""Exec mode's command runner, bounded whatever the command does (issue 15).

These run real commands (Python and sh) without a database: the runner is
what decides memory, time and what text reaches the archive.
"""

import resource
import sys
import time
from types import SimpleNamespace

import pytest

from django_dbqueue.exceptions import CommandFailed
from django_dbqueue.execmode import TAIL, ExecHandler
from tests.support.processes import alive

PY = sys.executable


def message(**payload):
    """What ExecHandler reads of a message; never cancelled (tests/test_cancel.py runs cancels for real)."""
    return SimpleNamespace(
        pk=1, queue="q", kind="", attempts=1, headers={}, payload=payload, cancel_requested=lambda: False
    )


def program(tmp_path, text: str) -> str:
    """A Python program in a file, as an --exec command line."""
    path = tmp_path / "program.py"
    path.write_text(text)
    return f"{PY} {path}"


def test_a_flood_of_output_keeps_only_a_bounded_tail(tmp_path):
    """300 MB of output used to cost 600 MB of memory to keep 4,000 characters."""
    flood = (
        "import sys\nchunk = b'x' * 1_000_000\nfor _ in range(300):\n    sys.stdout.buffer.write(chunk)\nprint('END')\n"
    )
    handler = ExecHandler(program(tmp_path, flood))
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    result = handler(message())
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before
    assert grown < 100_000, f"our peak memory grew by {grown} KiB for output we keep 16 KB of"
    assert result.endswith("END\n") and len(result) <= TAIL


def test_a_background_child_holding_the_pipe_does_not_hold_the_message():
    handler = ExecHandler("sh -c 'sleep 30 & echo started'")
    started = time.monotonic()
    assert handler(message()).strip() == "started"
    assert time.monotonic() - started < 10  # not the 30 s the child keeps stdout open


def test_a_command_past_its_timeout_is_killed_with_its_process_group(tmp_path):
    pids = tmp_path / "pids"
    handler = ExecHandler(f"sh -c 'sleep 60 & echo $! > {pids}; sleep 60'", timeout=1)
    started = time.monotonic()
    with pytest.raises(CommandFailed, match="longer than 1s and was killed with its process group"):
        handler(message())
    assert time.monotonic() - started < 15
    child = int(pids.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not alive(child):  # gone, or a zombie its new parent has not collected yet
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the background child {child} outlived the timeout")


def test_nul_and_bad_bytes_in_output_come_back_storable(tmp_path):
    noisy = "import sys\nsys.stdout.buffer.write(b'ok\\x00\\xff')\nsys.stderr.buffer.write(b'bad\\x00')\nsys.exit(2)\n"
    with pytest.raises(CommandFailed) as failed:
        ExecHandler(program(tmp_path, noisy))(message())
    assert "bad\\x00" in str(failed.value) and "\x00" not in str(failed.value)
    quiet = "import sys\nsys.stdout.buffer.write(b'ok\\x00')\n"
    assert ExecHandler(program(tmp_path, quiet))(message()) == "ok\\x00"


def test_a_command_that_never_reads_its_stdin_still_finishes():
    big = "y" * 5_000_000  # more than a pipe buffer: writing it all would block without a reader
    assert ExecHandler("true")(message(big=big)) == ""
