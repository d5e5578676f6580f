"""Wall time and peak memory of a block of work, on CUDA or CPU."""

from __future__ import annotations

import os
import threading
import time
from typing import Optional

import torch

__all__ = ["Meter", "current_rss_bytes"]


def current_rss_bytes() -> int:
    """Resident set size of this process in bytes (Linux ``/proc``; psutil elsewhere; 0 if neither)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # psutil missing or unsupported platform
        return 0


class Meter:
    """Context manager measuring elapsed seconds and peak memory of the enclosed work.

    On CUDA the peak is ``torch.cuda.max_memory_allocated`` (reset on entry): tensors only,
    the number that decides out-of-memory. On CPU, torch's allocator is invisible to
    ``tracemalloc``, so a background thread samples the process RSS every ``interval`` seconds
    and reports the peak above the RSS at entry (``peak_bytes``) — an estimate that can miss
    allocations shorter than the interval.

    Attributes (after exit): ``seconds``, ``peak_bytes``, ``kind`` (``"cuda_max_allocated"`` or
    ``"cpu_rss_delta"``).
    """

    def __init__(self, device: Optional[torch.device] = None, interval: float = 0.002):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.interval = interval
        self.seconds = 0.0
        self.peak_bytes = 0
        self.kind = "cuda_max_allocated" if self.device.type == "cuda" else "cpu_rss_delta"
        self._stop = threading.Event()
        self._thread = None
        self._base = 0
        self._peak = 0

    def _sample(self):
        while not self._stop.is_set():
            self._peak = max(self._peak, current_rss_bytes())
            self._stop.wait(self.interval)

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._base = self._peak = current_rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds = time.perf_counter() - self._t0
        if self.device.type == "cuda":
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
        else:
            self._stop.set()
            self._thread.join()
            self._peak = max(self._peak, current_rss_bytes())
            self.peak_bytes = max(0, self._peak - self._base)
        return False
