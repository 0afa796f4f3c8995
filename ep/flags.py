"""Backend environment flags: declared once here, applied once by ``server.__main__`` before any backend loads.

Owns MIGRAPHX_ENABLE_INT4_GEMV (and its pass-through companions) and the CUDA EP's ORT_FPA_INTB_GEMM. Imports
no onnxruntime: applying a flag must not load the library that reads it.
"""

from __future__ import annotations

import fnmatch
import logging
import os
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from ep.names import is_auto, normalize_provider
from ep.profiles import (
    CUDA_INT4_GEMM_FLAG,
    MIGRAPHX_INT4_GEMV_FLAG,
    may_read_flag,
    reads_flag,
)

logger = logging.getLogger(__name__)

# Basenames (fnmatch) of the libraries that read the INT4 GEMV flag: MIGraphX itself, the AMDGPU
# umbrella plugin (libamdgpu-ep.so) and ORT's MIGraphX provider library (bridge or plugin).
# NOTE(flags): "libamdgpu*" must not match libdrm_amdgpu.so (a Mesa/libdrm library that loads with any
# GPU stack and never reads the flag); fnmatch on the basename keeps the prefix anchored.
BACKEND_LIBRARY_PATTERNS: tuple[str, ...] = (
    "libmigraphx*",
    "libamdgpu*",
    "amdgpu-ep*",
    "libonnxruntime_providers_migraphx*",
    "libonnxruntime_providers_amdgpu*",
)

# v_dot2_f32_f16 ("fdot2"), which MIGraphX's INT4 GEMV kernel needs; without it the fusion is
# silently declined. From the LLVM AMDGPU processor table (dot2/dot10 instruction sets).
_FDOT2_ARCHS = frozenset(
    {"gfx906", "gfx908", "gfx90a", "gfx940", "gfx941", "gfx942", "gfx950", "gfx1011", "gfx1012"}
    | {f"gfx103{i}" for i in range(7)}
    | {"gfx1100", "gfx1101", "gfx1102", "gfx1103", "gfx1150", "gfx1151", "gfx1152", "gfx1153"}
    | {"gfx1200", "gfx1201"}
)
_NO_FDOT2_ARCHS = frozenset(
    {"gfx700", "gfx701", "gfx702", "gfx703", "gfx704", "gfx705", "gfx801", "gfx802", "gfx803", "gfx805",
     "gfx810", "gfx900", "gfx902", "gfx904", "gfx909", "gfx90c", "gfx1010", "gfx1013"}
)


@dataclass(frozen=True)
class EnvFlag:
    """One process-global variable that a backend library reads once, at its first use."""

    name: str  # the families whose backend reads it say so (ep.profiles: env_flags)
    description: str
    passthrough: tuple[str, ...] = ()  # companions we report but never change
    library_patterns: tuple[str, ...] = ()  # basenames of the libraries that read it
    device_nodes: tuple[str, ...] = ()  # paths that exist where a GPU whose backend reads it is present


def worth_reporting(flag: EnvFlag, provider: str, requested: bool | None,
                    device_nodes: tuple[str, ...] | None = None) -> bool:
    """Whether the startup log shows ``flag`` at INFO (otherwise DEBUG).

    Yes when the user set it (``requested``), when ``provider`` (a short name) reads it, or under ``auto`` when one
    of the flag's device nodes exists (a GPU that ``auto`` may pick). No library is loaded to find out.
    NOTE(flags): so a CPU-only start says nothing about MIGraphX or CUDA; the variables are still set under
    ``auto`` (harmless there, and they must be in place before any backend could load).
    """
    if requested is not None or reads_flag(provider, flag.name):
        return True
    nodes = flag.device_nodes if device_nodes is None else device_nodes
    return is_auto(provider) and any(os.path.exists(path) for path in nodes)


INT4_GEMV = EnvFlag(
    name=MIGRAPHX_INT4_GEMV_FLAG,
    description="MIGraphX INT4 GEMV fusion for M=1 (decode) MatMulNBits; any value, '0' too, turns it on",
    passthrough=("MIGRAPHX_INT4_GEMV_CONFIG", "MIGRAPHX_INT4_GEMV_TRACE"),
    library_patterns=BACKEND_LIBRARY_PATTERNS,
    device_nodes=("/dev/kfd",),  # the ROCm kernel driver's node: an AMD GPU
)
# NOTE(flags): the CUDA EP's fused INT4 kernels for MatMulNBits (fpA_intB: a CUTLASS mixed-input GEMM and its
# GEMV, weights repacked at load), read by each MatMulNBits kernel when a session is made ("" / "0" / "off" is off).
# Its session-config twin (ep.cuda.fpa_intb_gemm) cannot be used: a session whose EP is added for its OrtEpDevice
# hands every ep.cuda.* entry to the EP as a provider option, and the CUDA EP aborts the process on the unknown
# option. Measured (synthetic Llama-3.2-1B, Q4_0 block 32, fp16, the engine's captured decode steps;
# docs/perf/GPU.md): 1 row 18% slower, 2 to 64 rows 12-43% faster; the session loads seconds slower (the kernels'
# profiling). So: on where a batch can form.
CUDA_INT4_GEMM = EnvFlag(
    name=CUDA_INT4_GEMM_FLAG,
    description="the CUDA EP's fused INT4 GEMM/GEMV for MatMulNBits; '0' or 'off' turns it off",
    device_nodes=("/dev/nvidiactl",),  # the NVIDIA driver's control node: an NVIDIA GPU
)
REGISTRY: tuple[EnvFlag, ...] = (INT4_GEMV, CUDA_INT4_GEMM)


def apply_cuda_int4_gemm(provider: str, max_batch: int, requested: bool | None = None, *,
                         env: MutableMapping[str, str] | None = None,
                         device_nodes: tuple[str, ...] | None = None) -> str | None:
    """Set ORT_FPA_INTB_GEMM for a server of ``max_batch`` rows, before its first session.

    ``requested``: True -> "1", False -> "0"; None -> "1" when ``max_batch > 1``, unless the environment already
    sets it (the user's own choice stands). Providers other than cuda and auto leave the environment alone.
    ``device_nodes``: the paths ``worth_reporting`` checks (default: the flag's own).

    Returns:
        The one-line report logged (None when nothing applies).
    """
    provider = normalize_provider(provider, allow_auto=True)
    if not may_read_flag(provider, CUDA_INT4_GEMM.name):
        return None
    env = os.environ if env is None else env
    name = CUDA_INT4_GEMM.name
    if requested is None and name in env:
        report = f"{name}={env[name]!r} (from the environment)"
    else:
        on = requested if requested is not None else max_batch > 1
        env[name] = "1" if on else "0"
        why = "asked for" if requested is not None else f"--max-batch {max_batch}"
        report = f"{name}={env[name]} ({why})"
    log = logger.info if worth_reporting(CUDA_INT4_GEMM, provider, requested, device_nodes) else logger.debug
    log("backend flags: %s: %s", report, CUDA_INT4_GEMM.description)
    return report


@contextmanager
def cuda_int4_gemm_off(env: MutableMapping[str, str] | None = None) -> Iterator[None]:
    """Sessions made inside the block take ORT's own MatMulNBits kernels (ORT_FPA_INTB_GEMM="0" for the block; the
    variable is read by each kernel as a session is made, so sessions made before and after keep theirs).

    NOTE(flags): for a session of its own beside the server's (engine.placement's one-row decode session); the
    engine makes its sessions on one thread, at load.
    """
    env = os.environ if env is None else env
    name = CUDA_INT4_GEMM.name
    before = env.get(name)
    env[name] = "0"
    try:
        yield
    finally:
        if before is None:
            env.pop(name, None)
        else:
            env[name] = before


def cuda_int4_gemm_on(env: Mapping[str, str] | None = None) -> bool:
    """Whether the CUDA EP's sessions made from now on take the fused INT4 kernels (ORT_FPA_INTB_GEMM > 0)."""
    value = (os.environ if env is None else env).get(CUDA_INT4_GEMM.name, "0").strip()
    try:
        return int(value, 0) > 0
    except ValueError:
        return False


@dataclass(frozen=True)
class GpuArch:
    """One HIP device as hip-python sees it."""

    index: int  # HIP device ordinal
    arch: str  # gcnArchName base, e.g. "gfx1151"
    has_fdot2: bool | None  # None: an arch this table does not know


@dataclass(frozen=True)
class FlagReport:
    """What ``apply`` did; logged at startup and shown by ``ortserve devices``."""

    provider: str  # short name or "auto"
    flag: str
    requested: bool | None  # --int4-gemv / --no-int4-gemv; None = the default
    relevant: bool  # the provider's backend reads the flag (auto counts: it may pick AMDGPU)
    enabled: bool  # the variable is set after apply (MIGraphX: set means on)
    value: str | None  # its value after apply
    previous: str | None  # its value before apply
    late: bool  # a library that reads it was already loaded: the change cannot take effect
    loaded_libraries: tuple[str, ...] = ()  # those libraries' paths
    passthrough: tuple[tuple[str, str], ...] = ()  # companions that are set, as (name, value)
    hip_python: bool = False  # hip-python was importable and answered
    gpus: tuple[GpuArch, ...] = ()
    messages: tuple[str, ...] = field(default=())  # plain sentences for the log and the CLI

    @property
    def effective(self) -> bool | None:
        """True/False when the flag is known to be in force/off for the backend; None if it cannot be known."""
        return None if self.late else self.enabled

    def to_dict(self) -> dict:
        return {
            "provider": self.provider, "flag": self.flag, "requested": self.requested,
            "relevant": self.relevant, "enabled": self.enabled, "value": self.value,
            "previous": self.previous, "late": self.late, "effective": self.effective,
            "loaded_libraries": list(self.loaded_libraries), "passthrough": dict(self.passthrough),
            "hip_python": self.hip_python,
            "gpus": [{"index": g.index, "arch": g.arch, "has_fdot2": g.has_fdot2} for g in self.gpus],
            "messages": list(self.messages),
        }

    def summary(self) -> str:
        """One line for the startup log."""
        state = "on" if self.enabled else "off"
        line = f"{self.flag}={self.value if self.enabled else '(unset)'} ({state})"
        return " ".join((line, *self.messages))


def has_fdot2(arch: str) -> bool | None:
    """Whether an AMD GPU architecture has the fdot2 instruction (v_dot2_f32_f16).

    Args:
        arch: gcnArchName as HIP reports it, with or without target features ("gfx90a:sramecc+:xnack-").

    Returns:
        True or False for a known architecture, None for one this table does not list.
    """
    base = arch.strip().lower().split(":", 1)[0]
    if base in _FDOT2_ARCHS:
        return True
    if base in _NO_FDOT2_ARCHS:
        return False
    return None


def loaded_libraries(patterns: tuple[str, ...] = BACKEND_LIBRARY_PATTERNS,
                     maps_path: str = "/proc/self/maps") -> tuple[str, ...] | None:
    """Paths of the shared libraries mapped into this process whose basename matches a pattern.

    Args:
        patterns: fnmatch patterns matched against each mapped file's basename.
        maps_path: the process's memory map (Linux); another process's map may be passed.

    Returns:
        Sorted unique paths, or None where the map cannot be read (not Linux): then lateness is unknown.
    """
    try:
        with open(maps_path, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return None
    found: set[str] = set()
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue  # anonymous mapping, [heap], [stack], ...
        path = parts[5].strip().removesuffix(" (deleted)")
        base = os.path.basename(path)
        if any(fnmatch.fnmatchcase(base, p) for p in patterns):
            found.add(path)
    return tuple(sorted(found))


def gpu_archs() -> tuple[GpuArch, ...] | None:
    """The HIP devices and their fdot2 support, through hip-python; None when it is not importable."""
    try:
        from hip import hip  # optional `rocm` extra
    except (ImportError, OSError):
        return None
    try:
        err, count = hip.hipGetDeviceCount()
        if int(err) != 0:
            return ()
        archs = []
        for index in range(int(count)):
            props = hip.hipDeviceProp_t()
            result = hip.hipGetDeviceProperties(props, index)
            err = result[0] if isinstance(result, tuple) else result
            if int(err) != 0:
                continue
            name = props.gcnArchName
            name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
            base = name.split(":", 1)[0]
            archs.append(GpuArch(index=index, arch=base, has_fdot2=has_fdot2(base)))
        return tuple(archs)
    except Exception as e:  # noqa: BLE001 - a diagnostic must never stop startup
        logger.warning("hip-python is installed but could not list GPUs: %s", e)
        return ()


def apply(
    provider: str,
    int4_gemv: bool | None = None,
    *,
    env: MutableMapping[str, str] | None = None,
    library_patterns: tuple[str, ...] | None = None,
    maps_path: str = "/proc/self/maps",
    probe_gpus: bool = True,
    device_nodes: tuple[str, ...] | None = None,
) -> FlagReport:
    """Set or unset the backend flags for ``provider``; call once, before any backend library loads.

    That is: before ``ep.device`` registers a plugin EP library and before the first session. MIGraphX
    reads MIGRAPHX_ENABLE_INT4_GEMV once, on first use, and treats any value ("0" too) as on, so the off
    switch unsets it.

    Args:
        provider: "auto" or any spelling of a provider name.
        int4_gemv: True forces "1", False unsets, None is the default (on for auto/amdgpu/migraphx;
            other providers leave the environment as it is).
        env: the environment to change; os.environ unless a test passes its own mapping.
        library_patterns: basenames of the libraries that read the flag (default: the flag's own).
        maps_path: the memory map searched for those libraries.
        probe_gpus: ask hip-python (when importable) for each GPU's arch and fdot2 support.
        device_nodes: the paths ``worth_reporting`` checks under auto (default: the flag's own).

    Returns:
        A FlagReport; ``late=True`` says plainly that the flag cannot take effect in this process.
    """
    provider = normalize_provider(provider, allow_auto=True)
    env = os.environ if env is None else env
    flag = INT4_GEMV
    patterns = flag.library_patterns if library_patterns is None else library_patterns
    relevant = may_read_flag(provider, flag.name)
    previous = env.get(flag.name)
    messages: list[str] = []

    # 1. Decide: an explicit choice wins; otherwise on where MIGraphX may run, untouched elsewhere.
    want = int4_gemv if int4_gemv is not None else (True if relevant else None)
    if want is True:
        env[flag.name] = "1"
    elif want is False:
        env.pop(flag.name, None)
        if previous is not None:
            messages.append(f"unset (was {previous!r}: MIGraphX treats any value, '0' too, as on).")
    value = env.get(flag.name)
    if not relevant:
        messages.append(f"Not read by the {provider} provider.")

    # 2. Too late? A library that reads the flag may already be in the process.
    loaded = loaded_libraries(patterns, maps_path)
    late = bool(loaded) and relevant
    if loaded is None:
        messages.append("Cannot tell whether the backend is already loaded (no /proc/self/maps).")
    elif late:
        messages.append(
            f"{flag.name} cannot take effect: {', '.join(os.path.basename(p) for p in loaded)} is already "
            "loaded in this process and reads it once; set it in the environment before starting.")

    # 3. Report the pass-through companions and, with hip-python, whether the GPU has fdot2.
    passthrough = tuple((name, env[name]) for name in flag.passthrough if name in env)
    archs = gpu_archs() if (probe_gpus and relevant) else None
    for gpu in archs or ():
        if gpu.has_fdot2 is False and value is not None:
            messages.append(f"GPU {gpu.index} ({gpu.arch}) lacks fdot2: MIGraphX will decline the INT4 GEMV fusion.")
    report = FlagReport(
        provider=provider, flag=flag.name, requested=int4_gemv, relevant=relevant,
        enabled=value is not None, value=value, previous=previous, late=late,
        loaded_libraries=tuple(loaded or ()), passthrough=passthrough,
        hip_python=archs is not None, gpus=tuple(archs or ()), messages=tuple(messages),
    )
    if late:
        log = logger.warning
    else:
        log = logger.info if worth_reporting(flag, provider, int4_gemv, device_nodes) else logger.debug
    log("backend flags: %s", report.summary())
    return report
