"""A chunk's K/V rows moved into their slots after a fused step (engines/ort_fused/backend.py): the
kernel writes a chunk's rows after the slots in use, F.., and the runtime moves them where the plan
puts them."""

from __future__ import annotations

import numpy as np


def move_rows(keys: np.ndarray, values: np.ndarray, start: int, slots: np.ndarray) -> None:
    """Move a chunk's rows start.. of (layers, kv_heads, rows, head_dim) buffers into `slots` (often
    the same rows: then nothing moves)."""
    n = len(slots)
    lo, hi = int(slots[0]), int(slots[-1]) + 1
    if n == 1:  # a decode step: one row per layer and head
        if lo != start:
            keys[:, :, lo] = keys[:, :, start]
            values[:, :, lo] = values[:, :, start]
    elif not (lo == start and hi - lo == n):
        where = slice(lo, hi) if hi - lo == n else slots
        for buf in (keys, values):
            # through a small copy: the rows never overlap, but numpy would prove it the slow way
            buf[:, :, where] = buf[:, :, start : start + n].copy()
