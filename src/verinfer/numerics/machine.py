"""Machine fingerprint: what bitwise results of the same code depend on.

Library kernels (oneDNN/MKL GEMMs, SDPA) pick their blocking and reduction order from the CPU's
instruction set, the BLAS build and the thread count (on a GPU: the device and CUDA build), so a
token stream that is bitwise reproducible on one machine can differ on another. Measured on the
shipped testbed (benchmarks/results/margingate.md, "Across machines"): the fixed-shape reference
of `best` recorded on an Intel Xeon (AMX) differed on an AMD EPYC (AVX512-BF16) in 11 of 80
sequences, the tiled batch-invariant reference in none.

`machine_fingerprint()` is recorded with every determinism result and fixture;
`fingerprint_mismatch(recorded, here)` names the fields that make a bitwise comparison between
the two meaningless.
"""

from __future__ import annotations

import platform
import re
from pathlib import Path

import torch

# the fields that change kernels' arithmetic (the rest is provenance)
BITWISE_FIELDS = ("cpu_model", "cpu_isa_flags", "machine", "torch", "blas", "onednn", "threads", "device_name")
_ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4")


def _cpuinfo_field(info: str, key: str) -> str:
    return next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith(key)), "")


def _build_line(pattern: str) -> str:
    """The first line of torch's build description that matches `pattern` ("" if none)."""
    return next((ln.strip(" -") for ln in torch.__config__.show().splitlines() if re.search(pattern, ln)), "")


def machine_fingerprint(threads: int | None = None, device: str | torch.device = "cpu") -> dict:
    """CPU model and ISA flags, torch, BLAS and oneDNN builds, torch threads, and the device
    (its name for CUDA). threads: the count the run uses (default: torch's current)."""
    cpuinfo = Path("/proc/cpuinfo")
    info = cpuinfo.read_text() if cpuinfo.is_file() else ""
    d = torch.device(device)
    fp = dict(
        cpu_model=_cpuinfo_field(info, "model name") or platform.processor(),
        cpu_isa_flags=sorted(f for f in _cpuinfo_field(info, "flags").split() if f.startswith(_ISA_PREFIXES)),
        machine=platform.machine(),
        torch=torch.__version__,
        blas=_build_line(r"Math Kernel Library|OpenBLAS|BLAS_INFO"),
        onednn=_build_line(r"MKL-DNN|oneDNN"),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        threads=threads if threads is not None else torch.get_num_threads(),
        device=d.type,
        device_name=torch.cuda.get_device_name(d) if d.type == "cuda" else "",
    )
    if d.type == "cuda":
        fp["cuda"] = torch.version.cuda
    return fp


def fingerprint_mismatch(recorded: dict, here: dict, fields: tuple[str, ...] = BITWISE_FIELDS) -> str | None:
    """Why results recorded under `recorded` need not be bitwise equal here, or None. Fields a
    recording lacks (an older format) are not compared."""
    why = [f"{k}: recorded {recorded[k]!r}, here {here.get(k)!r}" for k in fields
           if k in recorded and recorded[k] != here.get(k)]
    return "; ".join(why) or None
