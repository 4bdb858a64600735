"""Facts about the CPU the kernels choose by (`fused.dense_rule`, `few_rows`): its vendor, family and feature flags
as /proc/cpuinfo gives them, and the limit the environment sets on oneDNN's instruction set."""

from __future__ import annotations

import os

# oneDNN's CPU limits (`ONEDNN_MAX_CPU_ISA`, formerly `DNNL_MAX_CPU_ISA`) that keep its kernels off AVX-512.
_LIMITS_BELOW_AVX512 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2"}
# Those that keep them off AMX as well.
_LIMITS_BELOW_AMX = _LIMITS_BELOW_AVX512 | {"AVX512_CORE", "AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX512_CORE_FP16",
                                            "AVX10_1_512"}


def cpuinfo(key: str) -> str:
    """The first value /proc/cpuinfo gives `key` (``"vendor_id"``, ``"cpu family"``, ``"flags"``); ``""`` where there
    is none (another key, another OS)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as lines:
            for line in lines:
                name, _, value = line.partition(":")
                if name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it (``"GenuineIntel"``, ``"AuthenticAMD"``); ``""`` where unknown."""
    return cpuinfo("vendor_id")


def cpu_family() -> int:
    """The CPU's family number (AMD: 25 for Zen 3 and Zen 4, 26 for Zen 5); 0 where unknown."""
    family = cpuinfo("cpu family")
    return int(family) if family.isdigit() else 0


def cpu_has(*flags: str) -> bool:
    """Whether /proc/cpuinfo lists every flag in `flags` (``"avx2"``, ``"avx512f"``)."""
    return set(flags) <= set(cpuinfo("flags").split())


def held_below_avx512() -> bool:
    """Whether the environment holds oneDNN below AVX-512 (``ONEDNN_MAX_CPU_ISA=AVX2`` and the like), as one does to
    run an AVX2-only CPU's paths on an AVX-512 one. oneDNN reads the limit once, from the environment."""
    return _limit() in _LIMITS_BELOW_AVX512


def held_below_amx() -> bool:
    """Whether the environment holds oneDNN below AMX (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``, or below AVX-512)."""
    return _limit() in _LIMITS_BELOW_AMX


def _limit() -> str:
    return (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
