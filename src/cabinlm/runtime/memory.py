"""Process memory, read from the OS (no psutil on the car)."""

from __future__ import annotations

import os
import resource
import sys


def rss_bytes() -> int:
    """Resident set size of this process now (Linux: /proc; elsewhere: the peak as a fallback)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def rss_mb() -> float:
    return rss_bytes() / (1 << 20)
