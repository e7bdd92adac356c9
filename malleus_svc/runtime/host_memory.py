"""This process's resident memory, now and at its peak since the last reset (Linux procfs).

The peak is the kernel's high-water mark (``VmHWM``), which writing 5 to ``/proc/self/clear_refs``
resets, so one operation's peak can be read on its own, like CUDA's peak allocation after
`torch.cuda.reset_peak_memory_stats`. Without procfs the peak is the process's lifetime maximum.
"""
from __future__ import annotations

import re
import resource

_FIELD = re.compile(r"^(VmRSS|VmHWM):\s+(\d+) kB", re.M)


def _status() -> dict[str, int]:
    try:
        with open("/proc/self/status") as f:
            return {k: int(v) * 1024 for k, v in _FIELD.findall(f.read())}
    except OSError:
        return {}


def resident() -> int:
    """Bytes resident now."""
    return _status().get("VmRSS") or peak()


def peak() -> int:
    """Bytes resident at the peak since the last `reset_peak` (or since the process started)."""
    return _status().get("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak() -> bool:
    """Start a new peak from what is resident now; False where the kernel does not offer it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
