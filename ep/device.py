"""EP devices: plugin EP library registration, the device inventory and ``--provider``/``--device`` selection.

Imports onnxruntime. Registration loads backend libraries, so ``ep.flags.apply`` must run first.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnxruntime as ort

from ep.addressing import Addressing, memory_addressing
from ep.flags import cuda_int4_gemm_on
from ep.names import (
    EP_NAMES,
    DeviceNotFoundError,
    EpError,
    EpLibraryError,
    EpOptionError,
    expand_providers,
    matching,
    needs_library,
    normalize_provider,
    provider_of_ep_name,
    selects,
)
from ep.profiles import DeviceProfile, make_profile, profile_class

logger = logging.getLogger(__name__)

AMDGPU_EP_PATH_ENV = "AMDGPU_EP_PATH"
# Python packages that ship a plugin EP library, by provider. Each exposes get_library_path() (the
# onnxruntime-ep-* convention); if one does not, its folder is searched for the file names below.
_PACKAGES: dict[str, tuple[str, ...]] = {
    "amdgpu": ("onnxruntime_ep_amdgpu",),
    "migraphx": ("onnxruntime_ep_migraphx",),
    "webgpu": ("onnxruntime_ep_webgpu",),
    "openvino": ("onnxruntime_ep_openvino",),
}
_LIBRARY_FILES: dict[str, tuple[str, ...]] = {
    "amdgpu": ("libamdgpu-ep.so", "amdgpu-ep.dll"),
    "migraphx": ("libonnxruntime_providers_migraphx.so",),
    "webgpu": ("libonnxruntime_providers_webgpu.so", "onnxruntime_providers_webgpu.dll"),
    "openvino": ("libonnxruntime_providers_openvino_plugin.so", "onnxruntime_providers_openvino_plugin.dll"),
}
# Provider-bridge libraries that some onnxruntime builds ship in capi/ (onnxruntime-gpu, -migraphx); ORT
# registers them like plugins, which gives them OrtEpDevices too.
_BRIDGES: dict[str, str] = {"cuda": "libonnxruntime_providers_cuda.so",
                            "migraphx": "libonnxruntime_providers_migraphx.so"}
# The providers whose library may be named by path: --ep-library, else this environment variable.
_PATH_ENVS: dict[str, str] = {"amdgpu": AMDGPU_EP_PATH_ENV}

# Why a registered plugin may offer no device (shown with DeviceNotFoundError).
_NO_DEVICE_HINTS: dict[str, str] = {
    "openvino": "it offers devices for Intel hardware (PCI vendor 8086) only",
    "webgpu": "no GPU adapter (on Linux it needs the Vulkan loader libvulkan.so.1 and a GPU driver)",
}

_PCI_RE = re.compile(r"^(?:([0-9a-f]{1,8}):)?([0-9a-f]{1,2}):([0-9a-f]{1,2})\.([0-7])$")
_IDS_RE = re.compile(r"^(?:0x)?([0-9a-f]{1,4}):(?:0x)?([0-9a-f]{1,4})$")


@dataclass(frozen=True)
class EpLibrary:
    """One plugin EP library this process tried to register."""

    provider: str  # the provider it was looked up for ("amdgpu" for --ep-library)
    path: str
    source: str  # "--ep-library", "AMDGPU_EP_PATH", "package onnxruntime_ep_webgpu", "onnxruntime capi"
    registered: bool
    error: str | None = None  # why registration failed


# NOTE(ep): where a device's own memory is reported. ORT's Windows discovery puts DXGI's dedicated video memory in
# the hardware metadata ("DxgiVideoMemory": "<N> MB"); the OpenVINO EP puts its device's total in its EP metadata
# (bytes); on Linux the amdgpu driver (AMDGPU, MIGraphX) exposes mem_info_vram_total (bytes) on the PCI device whose
# bus id ORT's discovery reports. NVIDIA's driver has no such file: NVML (nvidia-ml-py) reads it by the same bus id
# (the CUDA EP's device reports one, e.g. 0000:00:06.0 on the H100/H200 test machines).
_EP_MEMORY_KEYS = ("GPU_DEVICE_TOTAL_MEM_SIZE", "NPU_DEVICE_TOTAL_MEM_SIZE")
_MEMORY_UNITS = {"B": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}
SYSFS = Path("/sys")


@dataclass(frozen=True)
class DeviceRecord:
    """A plain description of one OrtEpDevice; also built by hand in tests where the hardware is absent."""

    index: int  # position among the devices of the same ep_name: the --device index
    ep_name: str
    ep_vendor: str = ""
    device_type: str = "CPU"  # "CPU" | "GPU" | "NPU"
    vendor: str = ""
    vendor_id: int = 0  # PCI vendor id, e.g. 0x1002 (AMD)
    device_id: int = 0  # PCI device id of the hardware (not the memory-info device id)
    pci_bus_id: str | None = None  # from the hardware metadata, where ORT found one
    default_memory_device_id: int | None = None  # ep_device.memory_info(DEFAULT).device_id
    default_memory_name: str | None = None
    host_accessible_device_id: int | None = None  # ep_device.memory_info(HOST_ACCESSIBLE).device_id
    host_accessible_memory_name: str | None = None
    metadata: tuple[tuple[str, str], ...] = ()
    ep_metadata: tuple[tuple[str, str], ...] = ()

    @property
    def provider(self) -> str | None:
        return provider_of_ep_name(self.ep_name)

    @property
    def host_accessible(self) -> bool:
        return self.host_accessible_memory_name is not None

    @property
    def kv_addressing(self) -> Addressing:
        """How one KV row of this device's DEFAULT memory can be bound (``ep.addressing``)."""
        return memory_addressing(self.default_memory_name, self.vendor_id)

    def memory_bytes(self, sysfs: Path = SYSFS) -> int | None:
        """The device's own memory in bytes, as ORT or its driver reports it; None where nothing reports it (a CPU
        device, whose memory is the host's RAM and which carries none of these reports, or a GPU without one).

        Args:
            sysfs: the root of sysfs (tests give a folder of their own).
        """
        ep_metadata, metadata = dict(self.ep_metadata), dict(self.metadata)
        for key in _EP_MEMORY_KEYS:
            if ep_metadata.get(key, "").strip().isdigit():
                return int(ep_metadata[key])
        number, _, unit = metadata.get("DxgiVideoMemory", "").strip().partition(" ")
        if number.isdigit() and unit.strip().upper() in _MEMORY_UNITS:
            return int(number) * _MEMORY_UNITS[unit.strip().upper()]
        if self.pci_bus_id:
            try:
                text = (sysfs / "bus" / "pci" / "devices" / _normalize_pci(self.pci_bus_id) /
                        "mem_info_vram_total").read_text(encoding="ascii").strip()
            except OSError:
                return nvml_memory_bytes(self.pci_bus_id) if self.vendor_id == NVIDIA_VENDOR_ID else None
            return int(text) if text.isdigit() else None
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index, "ep_name": self.ep_name, "provider": self.provider,
            "ep_vendor": self.ep_vendor, "device_type": self.device_type, "vendor": self.vendor,
            "vendor_id": f"{self.vendor_id:04x}", "device_id": f"{self.device_id:04x}",
            "pci_bus_id": self.pci_bus_id,
            "default_memory": _mem_dict(self.default_memory_name, self.default_memory_device_id),
            "host_accessible_memory": _mem_dict(self.host_accessible_memory_name, self.host_accessible_device_id),
            "host_accessible": self.host_accessible, "kv_addressing": str(self.kv_addressing),
            "metadata": dict(self.metadata), "ep_metadata": dict(self.ep_metadata),
        }

    def describe(self) -> str:
        """One line for logs and error messages."""
        where = f" pci={self.pci_bus_id}" if self.pci_bus_id else ""
        mem = f" mem_id={self.default_memory_device_id}" if self.default_memory_device_id is not None else ""
        host = " host-accessible" if self.host_accessible else ""
        return (f"[{self.index}] {self.ep_name}: {self.device_type} {self.vendor or '?'} "
                f"{self.vendor_id:04x}:{self.device_id:04x}{where}{mem}{host} kv={self.kv_addressing}")


def _mem_dict(name: str | None, device_id: int | None) -> dict[str, Any] | None:
    return None if name is None else {"name": name, "device_id": device_id}


@dataclass(frozen=True)
class Selector:
    """A parsed --device value: an index, a PCI bus id or "vendor:device" hex ids."""

    text: str
    index: int | None = None
    pci_bus_id: str | None = None  # normalized "dddd:bb:dd.f"
    vendor_id: int | None = None
    device_id: int | None = None

    def matches(self, record: DeviceRecord) -> bool:
        if self.index is not None:
            return record.index == self.index
        if self.pci_bus_id is not None:
            return record.pci_bus_id is not None and _normalize_pci(record.pci_bus_id) == self.pci_bus_id
        return record.vendor_id == self.vendor_id and record.device_id == self.device_id


@dataclass(frozen=True)
class SelectedDevice:
    """The one device this process runs on (one device per process).

    ``device_id`` is the id used everywhere (KV allocation, host-accessible pool, logs): the DEFAULT
    memory info's device id of the filtered OrtEpDevice, never a hard-coded 0.
    """

    provider: str  # short name, e.g. "amdgpu"
    ep_name: str  # e.g. "AMDGPUExecutionProvider"
    ep_device: ort.OrtEpDevice | None  # None for the plain CPU EP
    device_id: int
    default_memory: ort.OrtMemoryInfo | None  # None where the EP offers none (CPU-side EPs)
    host_accessible_memory: ort.OrtMemoryInfo | None  # None where the EP offers none
    record: DeviceRecord
    libraries: tuple[EpLibrary, ...] = field(default=())

    @property
    def is_cpu_ep(self) -> bool:
        return self.ep_device is None

    @property
    def has_host_accessible(self) -> bool:
        return self.host_accessible_memory is not None

    @property
    def kv_addressing(self) -> Addressing:
        """How a KV row in this device's DEFAULT memory is bound: host views, pointer + offset, or opaque."""
        return self.record.kv_addressing

    @functools.cached_property
    def profile(self) -> DeviceProfile:
        """This device's family profile (``ep.profiles``): every per-device default, built once."""
        return make_profile(self, cuda_int4_gemm_on)


# NOTE(ep): ORT's EP library registry is process-global and refuses a second registration under the same
# name; this mirrors it so that select_device()/describe() can be called more than once in a process.
_REGISTERED: dict[str, EpLibrary] = {}


def parse_selector(text: str | None) -> Selector | None:
    """Parse ``--device``: "1" (index among the EP's devices), "0000:03:00.0"/"03:00.0" (PCI bus id) or
    "1002:744c" (vendor:device, hex). None or "" means no selector.

    Raises:
        EpOptionError: none of those forms.
    """
    if text is None or not str(text).strip():
        return None
    t = str(text).strip().lower()
    if t.isdigit():
        return Selector(text=text, index=int(t))
    if _PCI_RE.match(t):
        return Selector(text=text, pci_bus_id=_normalize_pci(t))
    m = _IDS_RE.match(t)
    if m:
        return Selector(text=text, vendor_id=int(m.group(1), 16), device_id=int(m.group(2), 16))
    raise EpOptionError(f"--device {text!r} is not an index (0), a PCI bus id (0000:03:00.0) "
                        "or vendor:device hex ids (1002:744c)")


NVIDIA_VENDOR_ID = 0x10DE


def nvml_memory_bytes(pci_bus_id: str) -> int | None:
    """An NVIDIA GPU's total memory in bytes from NVML (nvidia-ml-py), found by its PCI bus id; None where NVML or
    the device is not there (no NVIDIA driver, another machine's id)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no driver library, or no device it can reach
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(_normalize_pci(pci_bus_id))
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def _normalize_pci(text: str) -> str:
    m = _PCI_RE.match(text.strip().lower())
    if not m:
        return text.strip().lower()
    domain, bus, dev, fn = m.groups()
    return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"


# --- plugin EP libraries ------------------------------------------------------------------------------


def find_ep_libraries(providers: Iterable[str], ep_library: str | None = None,
                      env: Mapping[str, str] | None = None) -> list[tuple[str, str, str]]:
    """The plugin libraries to register for ``providers``, in order, as (provider, path, source).

    AMDGPU comes from ``ep_library`` (--ep-library), else $AMDGPU_EP_PATH, else an installed package;
    the others from their packages (onnxruntime-ep-webgpu, -openvino, -migraphx) or onnxruntime's capi/.

    Raises:
        EpLibraryError: ``ep_library`` was given and is not a file.
    """
    env = os.environ if env is None else env
    found: list[tuple[str, str, str]] = []
    if ep_library:
        if not Path(ep_library).is_file():
            raise EpLibraryError(f"--ep-library {ep_library}: no such file")
        found.append(("amdgpu", os.path.abspath(ep_library), "--ep-library"))
    for provider in providers:
        path_env = _PATH_ENVS.get(provider)
        if path_env and ep_library:
            continue
        if path_env and env.get(path_env):
            found.append((provider, env[path_env], path_env))
            continue
        hit = _package_library(provider)
        bridge = _BRIDGES.get(provider)
        if hit is None and bridge:
            capi = Path(ort.__file__).parent / "capi" / bridge
            hit = (str(capi), "onnxruntime capi") if capi.is_file() else None
        if hit is not None:
            found.append((provider, *hit))
    return found


def _package_library(provider: str) -> tuple[str, str] | None:
    for module_name in _PACKAGES.get(provider, ()):
        if importlib.util.find_spec(module_name) is None:
            continue
        source = f"package {module_name}"
        module = importlib.import_module(module_name)  # these packages only locate their library
        get_path = getattr(module, "get_library_path", None)
        if callable(get_path):
            try:
                return str(get_path()), source
            except (OSError, RuntimeError) as e:  # the package says why its library is missing
                return str(Path(module.__file__).parent), f"{source}: {e}"
        for name in _LIBRARY_FILES.get(provider, ()):
            candidate = Path(module.__file__).parent / name
            if candidate.is_file():
                return str(candidate), source
    return None


def register_ep_libraries(provider: str = "auto", ep_library: str | None = None) -> tuple[EpLibrary, ...]:
    """Register the plugin EP libraries that ``provider`` may need (all known ones for "all").

    "auto" registers those of AUTO_ORDER; a named provider only its own, so that serving on the CPU never
    loads OpenVINO or a GPU stack. A library that fails is recorded with the reason and logged; only a
    failing ``--ep-library`` raises, because the user named it.

    Args:
        provider: "auto", "all" or any spelling of a provider name.
        ep_library: --ep-library PATH (the AMDGPU EP library, or any plugin EP library).

    Returns:
        One EpLibrary per library tried, registered or not.

    Raises:
        EpLibraryError: ``ep_library`` is missing or ORT refused it (the message says which path and why).
    """
    results = []
    # (the CPU EP has no library: find_ep_libraries finds none for it)
    for prov, path, source in find_ep_libraries(expand_providers(provider), ep_library):
        lib = _register(prov, path, source)
        if not lib.registered and source == "--ep-library":
            raise EpLibraryError(f"--ep-library {path}: registration failed: {lib.error}")
        results.append(lib)
    return tuple(results)


def _register(provider: str, path: str, source: str) -> EpLibrary:
    name = f"ortserve.{provider}"
    done = _REGISTERED.get(name)
    if done is not None and (done.path == path or done.registered):
        return done
    if not Path(path).is_file():
        lib = EpLibrary(provider, path, source, registered=False, error="no such file")
    else:
        try:
            ort.register_execution_provider_library(name, path)
            lib = EpLibrary(provider, path, source, registered=True)
        except Exception as e:  # noqa: BLE001 - ORT raises several pybind classes; the text is the reason
            lib = EpLibrary(provider, path, source, registered=False, error=str(e).strip() or type(e).__name__)
    _REGISTERED[name] = lib
    if lib.registered:
        logger.info("registered %s EP library %s (from %s)", provider, path, source)
    else:
        logger.warning("could not register the %s EP library %s (from %s): %s", provider, path, source, lib.error)
    return lib


# --- inventory and selection ------------------------------------------------------------------------------


def record_of(ep_device: ort.OrtEpDevice, index: int) -> DeviceRecord:
    """Describe one OrtEpDevice (``index`` = its position among devices of the same EP name)."""
    hw = ep_device.device
    default = ep_device.memory_info(ort.OrtDeviceMemoryType.DEFAULT)
    host = ep_device.memory_info(ort.OrtDeviceMemoryType.HOST_ACCESSIBLE)
    metadata = {str(k): str(v) for k, v in dict(hw.metadata).items()}
    return DeviceRecord(
        index=index, ep_name=ep_device.ep_name, ep_vendor=ep_device.ep_vendor,
        device_type=str(hw.type).rsplit(".", 1)[-1], vendor=hw.vendor, vendor_id=int(hw.vendor_id),
        device_id=int(hw.device_id), pci_bus_id=metadata.get("pci_bus_id"),
        default_memory_device_id=None if default is None else int(default.device_id),
        default_memory_name=None if default is None else default.name,
        host_accessible_device_id=None if host is None else int(host.device_id),
        host_accessible_memory_name=None if host is None else host.name,
        metadata=tuple(sorted(metadata.items())),
        ep_metadata=tuple(sorted((str(k), str(v)) for k, v in dict(ep_device.ep_metadata).items())),
    )


def _inventory() -> list[tuple[DeviceRecord, ort.OrtEpDevice]]:
    counts: dict[str, int] = {}
    pairs = []
    for ep_device in ort.get_ep_devices():
        index = counts.get(ep_device.ep_name, 0)
        counts[ep_device.ep_name] = index + 1
        pairs.append((record_of(ep_device, index), ep_device))
    return pairs


def list_devices(provider: str = "all", ep_library: str | None = None) -> tuple[DeviceRecord, ...]:
    """Every EP device ORT sees, after registering the plugin libraries ``provider`` may need."""
    register_ep_libraries(provider, ep_library)
    return tuple(record for record, _ in _inventory())


def choose(records: Sequence[DeviceRecord], provider: str, selector: Selector | None,
           libraries: Sequence[EpLibrary] = ()) -> DeviceRecord:
    """Pick the device for ``provider`` ("auto" or a short name) and ``selector`` among ``records``.

    For a named provider, the devices are those whose EP name is exactly the provider's (falling back to
    any EP name that normalizes to it, e.g. "OpenVINOExecutionProvider.AUTO"); the selector index counts
    among them. "auto" takes the first provider of AUTO_ORDER with a device that matches the selector.

    Raises:
        DeviceNotFoundError: nothing matches; the message lists the devices that exist and any library
            that failed to register.
    """
    for prov in expand_providers(provider):
        found = [r for r in matching(records, prov) if selector is None or selector.matches(r)]
        if found:
            return found[0]
    wanted = EP_NAMES.get(provider, "any provider")
    what = f"no {wanted} device" + (f" matches --device {selector.text!r}" if selector else "")
    lines = [f"{what}. Devices ONNX Runtime sees:"] + [f"  {r.describe()}" for r in records]
    for lib in libraries:
        if not selects(provider, lib.provider):
            continue
        if not lib.registered:
            lines.append(f"  (the {lib.provider} EP library {lib.path} from {lib.source} failed: {lib.error})")
        elif not matching(records, lib.provider):
            why = _NO_DEVICE_HINTS.get(lib.provider, "it found no hardware it supports")
            lines.append(f"  (the {lib.provider} EP library {lib.path} registered but offers no device: {why})")
    if needs_library(provider) and not any(selects(provider, lib.provider) for lib in libraries):
        lines.append(f"  (no {provider} EP library was found: see --ep-library, ${AMDGPU_EP_PATH_ENV} "
                     f"or the onnxruntime-ep-{provider} package)")
    raise DeviceNotFoundError("\n".join(lines))


def select_device(provider: str = "auto", selector: str | None = None,
                  ep_library: str | None = None) -> SelectedDevice:
    """Register what ``provider`` needs, then filter ORT's EP devices by provider and ``--device``.

    Args:
        provider: "auto" or any spelling of a provider name (auto order: AMDGPU, MIGraphX, CUDA, WebGPU, CPU).
        selector: --device: index among that EP's devices, PCI bus id, or "vendor:device" hex ids.
        ep_library: --ep-library PATH for the AMDGPU EP (else $AMDGPU_EP_PATH, else an installed package).

    Returns:
        The SelectedDevice; its ``device_id`` is the DEFAULT memory info's device id.

    Raises:
        UnknownProviderError, EpOptionError (bad selector), EpLibraryError (bad --ep-library),
        DeviceNotFoundError (lists the devices that exist).
    """
    provider = normalize_provider(provider, allow_auto=True)
    parsed = parse_selector(selector)
    libraries = register_ep_libraries(provider, ep_library)
    pairs = _inventory()
    record = choose([r for r, _ in pairs], provider, parsed, libraries)
    ep_device = next(d for r, d in pairs if r is record)
    chosen = normalize_provider(record.ep_name)
    if profile_class(chosen).cpu_ep:
        # NOTE(ep): the CPU EP offers no memory infos; its memory is the host's and its only id is 0.
        selected = SelectedDevice("cpu", record.ep_name, None, 0, None, None, record, libraries)
    else:
        default = ep_device.memory_info(ort.OrtDeviceMemoryType.DEFAULT)
        host = ep_device.memory_info(ort.OrtDeviceMemoryType.HOST_ACCESSIBLE)
        # NOTE(ep): a CPU-side plugin device (OpenVINO CPU) may offer HOST_ACCESSIBLE but no DEFAULT memory.
        mem = default if default is not None else host
        device_id = int(mem.device_id) if mem is not None else 0
        if default is not None and host is not None and int(host.device_id) != int(default.device_id):
            logger.warning("%s: HOST_ACCESSIBLE memory device id %d differs from DEFAULT %d",
                           record.ep_name, int(host.device_id), int(default.device_id))
        selected = SelectedDevice(chosen, record.ep_name, ep_device, device_id, default, host, record, libraries)
    logger.info("selected %s (device id %d)", record.describe(), selected.device_id)
    return selected


# --- `ortserve devices` --------------------------------------------------------------------------------


def describe(provider: str = "auto", selector: str | None = None, ep_library: str | None = None,
             int4_gemv: bool | None = None) -> dict[str, Any]:
    """Everything ``ortserve devices`` shows: the flag report, the libraries, every device, the pick.

    Applies the backend flags itself (``ep.flags.apply``) before registering anything, so the caller must
    not load a backend first. Startup errors of the pick are reported in the result, not raised, except an
    unknown provider or a bad --ep-library / --device value.
    """
    from ep import flags  # noqa: PLC0415 - flags first, then registration (the order is the point)

    report = flags.apply(provider, int4_gemv)
    provider = normalize_provider(provider, allow_auto=True)
    libraries = register_ep_libraries("all", ep_library)
    records = [r for r, _ in _inventory()]
    pick: dict[str, Any] | None = None
    error = None
    try:
        chosen = select_device(provider, selector, ep_library)
        pick = {"ep_name": chosen.ep_name, "index": chosen.record.index, "device_id": chosen.device_id,
                "host_accessible": chosen.has_host_accessible}
    except EpError as e:
        if isinstance(e, EpOptionError | EpLibraryError):
            raise
        error = str(e)
    return {
        "onnxruntime": ort.__version__,
        "provider": provider, "device": selector, "ep_library": ep_library,
        "flags": report.to_dict(),
        "libraries": [dataclasses.asdict(lib) for lib in libraries],
        "devices": [r.to_dict() for r in records],
        "selected": pick, "error": error,
    }


def format_description(info: Mapping[str, Any]) -> str:
    """The text form of ``describe()`` for ``ortserve devices`` without --json."""
    lines = [f"onnxruntime {info['onnxruntime']}", "EP libraries:"]
    for lib in info["libraries"] or [{"provider": "-", "path": "none found", "source": "", "registered": False,
                                       "error": None}]:
        state = "registered" if lib["registered"] else f"not registered ({lib['error']})" if lib["error"] else ""
        lines.append(f"  {lib['provider']}: {lib['path']} {('[' + lib['source'] + ']') if lib['source'] else ''} "
                     f"{state}".rstrip())
    lines.append("Devices:")
    for d in info["devices"]:
        mem = d["default_memory"]
        host = d["host_accessible_memory"]
        lines.append(
            f"  [{d['index']}] {d['ep_name']}: {d['device_type']} {d['vendor'] or '?'} "
            f"{d['vendor_id']}:{d['device_id']}" + (f" pci={d['pci_bus_id']}" if d["pci_bus_id"] else "")
            + (f"\n      DEFAULT memory {mem['name']} id={mem['device_id']}" if mem else "\n      DEFAULT memory: none")
            + f" (KV rows: {d['kv_addressing']})"
            + (f"\n      HOST_ACCESSIBLE memory {host['name']} id={host['device_id']}" if host
               else "\n      HOST_ACCESSIBLE memory: none"))
    flag = info["flags"]
    lines.append(f"Flags: {flag['flag']}=" + (flag["value"] if flag["enabled"] else "(unset)")
                 + (" -- cannot take effect (backend already loaded)" if flag["late"] else ""))
    lines += [f"  {m}" for m in flag["messages"]]
    for name, value in flag["passthrough"].items():
        lines.append(f"  {name}={value}")
    for gpu in flag["gpus"]:
        lines.append(f"  GPU {gpu['index']}: {gpu['arch']} fdot2="
                     + {True: "yes", False: "no", None: "unknown"}[gpu["has_fdot2"]])
    sel = info["selected"]
    lines.append(f"serve --provider {info['provider']}"
                 + (f" --device {info['device']}" if info["device"] else "") + " would use: "
                 + (f"{sel['ep_name']} [{sel['index']}] (device id {sel['device_id']}, host-accessible "
                    f"{'yes' if sel['host_accessible'] else 'no'})" if sel else f"nothing\n{info['error']}"))
    return "\n".join(lines)

