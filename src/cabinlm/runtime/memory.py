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


def available_bytes() -> int | None:
    """Memory a new allocation can still get without swapping: MemAvailable of /proc/meminfo, and in a
    cgroup v2 container no more than its limit less its use. None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)  # "MemAvailable:  12345 kB"
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                found.append(max(0, int(limit) - int(f.read().strip())))
    except (OSError, ValueError):
        pass
    return min(found) if found else None
