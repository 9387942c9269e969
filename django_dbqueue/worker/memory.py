"""How much memory this process holds: what ``--max-memory-per-child`` compares against its limit."""

from __future__ import annotations

import os
import resource
import sys

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_megabytes() -> float:
    """This process's resident memory now, in megabytes (2**20 bytes).

    On Linux from ``/proc/self/statm`` (a read of a few microseconds, cheap
    between messages). Elsewhere the peak resident memory is what the system
    says (``getrusage``): a process whose memory grew past a limit once
    stays past it, which is what a leak does anyway.
    """
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE / 2**20
    except (OSError, IndexError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, kilobytes elsewhere
