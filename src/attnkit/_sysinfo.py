"""What machine this is, in words (for benchmark tables, the demo's report and kernel choices)."""

from __future__ import annotations

import platform
from functools import lru_cache
from pathlib import Path


def _cpuinfo_field(*names: str) -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(names):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` knows."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo ``flags`` or ``Features``); empty where unknown."""
    return frozenset(_cpuinfo_field("flags", "Features").split())


def cpu_isa() -> str:
    """The vector and matrix ISA of this CPU, in words: "AVX2", "AVX-512", "AVX-512, AVX-512-BF16",
    "AVX-512, AVX-512-BF16, AMX-BF16", or the machine name where the flags are not x86's."""
    f = cpu_flags()
    if "avx512f" in f:
        parts = ["AVX-512"]
        if "avx512_bf16" in f:
            parts.append("AVX-512-BF16")
        if "amx_bf16" in f:
            parts.append("AMX-BF16")
        return ", ".join(parts)
    if "avx2" in f:
        return "AVX2"
    if "avx" in f:
        return "AVX"
    return platform.machine() or "?"
