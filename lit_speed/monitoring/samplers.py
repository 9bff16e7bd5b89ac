"""Host and GPU readings for the device-stats logger.

Host numbers (RSS, peak RSS, process CPU %, available memory) are read on demand at interval
boundaries: each read costs microseconds, while a psutil sampling *thread* slowed 2-core training by
~25% on the development machine. GPU utilisation, power and temperature only mean something as an
average over time, so :class:`NvmlSampler` polls NVML (``nvidia-ml-py``, imported lazily) on a daemon
thread; the training loop only drains its buffer once per interval.
"""
from __future__ import annotations

import resource
import sys
import threading
from typing import Any

import psutil
import torch

from lit_speed.memory.host_memory import host_memory


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def batch_size_and_tokens(batch: Any) -> tuple[int, int]:
    """Samples in a batch, and tokens when its first tensor is an integer (B, T) token array (else 0)."""
    first = batch
    while isinstance(first, (list, tuple)) and first:
        first = first[0]
    if isinstance(batch, dict):
        first = next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return 0, 0
    samples = int(first.shape[0])
    tokens = int(first.numel()) if first.dim() == 2 and not first.is_floating_point() else 0
    return samples, tokens


class HostStats:
    """Reads this process's memory and CPU use and the host memory it can still get (cgroup-aware:
    :func:`~lit_speed.memory.host_memory.host_memory`).

    ``cpu_util_pct`` is the process's CPU time since the previous read over wall time, summed over
    cores (100 = one core fully busy), as :meth:`psutil.Process.cpu_percent` defines it.
    """

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._process.cpu_percent(None)  # first call starts the measurement window

    def read(self) -> dict[str, float]:
        rss = self._process.memory_info().rss
        return {
            "stats/cpu_rss_bytes": float(rss),
            # /proc's RSS and getrusage's high-water mark are kept by different kernel counters and can
            # disagree by a few pages; a peak is never below the current value
            "stats/cpu_rss_peak_bytes": float(max(rss, peak_rss_bytes())),
            "stats/cpu_util_pct": float(self._process.cpu_percent(None)),
            "stats/sys_mem_available_bytes": float(host_memory().available),
        }


def summarize_gpu_samples(samples: list[dict[str, float]]) -> dict[str, float]:
    """Reduce NVML samples of one interval to logged metrics: mean utilisation and power, max memory and heat.

    Each sample holds ``util_pct``, ``mem_used_bytes``, ``mem_total_bytes``, ``power_w`` and ``temp_c``;
    a reading NVML could not give (power on some boards) is absent and its metric is then omitted.
    """
    if not samples:
        return {}
    out: dict[str, float] = {}

    def values(key: str) -> list[float]:
        return [s[key] for s in samples if s.get(key) is not None]

    for key, metric, reduce in (("util_pct", "stats/gpu_util_pct", "mean"),
                                ("mem_used_bytes", "stats/gpu_mem_used_bytes", "max"),
                                ("mem_total_bytes", "stats/gpu_mem_total_bytes", "max"),
                                ("power_w", "stats/gpu_power_w", "mean"),
                                ("temp_c", "stats/gpu_temp_c", "max")):
        found = values(key)
        if found:
            out[metric] = sum(found) / len(found) if reduce == "mean" else max(found)
    return out


def cuda_device_uuid(device_index: int) -> str | None:
    """The NVML UUID (``"GPU-<uuid>"``) of a torch CUDA device; None without CUDA or an older torch."""
    import torch

    if not torch.cuda.is_available():
        return None
    uuid = getattr(torch.cuda.get_device_properties(device_index), "uuid", None)
    return f"GPU-{uuid}" if uuid is not None else None


def nvml_handle(pynvml: Any, device_index: int, uuid: str | None) -> Any:
    """The NVML handle of a device: by UUID (CUDA_VISIBLE_DEVICES renumbers devices), else by index."""
    if uuid is not None:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except pynvml.NVMLError:
            pass
    return pynvml.nvmlDeviceGetHandleByIndex(device_index)


def read_nvml(pynvml: Any, handle: Any) -> dict[str, float]:
    """One NVML reading; readings a board does not support are left out."""
    sample: dict[str, float] = {}
    readers = {
        "util_pct": lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu,
        "mem_used_bytes": lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used,
        "mem_total_bytes": lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).total,
        "power_w": lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,  # NVML reports milliwatts
        "temp_c": lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
    }
    for key, read in readers.items():
        try:
            sample[key] = float(read())
        except pynvml.NVMLError:
            continue
    return sample


class NvmlSampler:
    """Poll one GPU through NVML every ``every_s`` seconds on a daemon thread.

    A reading NVML refuses (``NVMLError``: unsupported on the board, a transient driver error) is left out
    of that sample; any other error in a reading is counted in :attr:`errors` and the thread keeps polling.

    Args:
        device_index: torch CUDA device index of this process.
        every_s: Seconds between readings.
        uuid: NVML UUID of the device (``"GPU-..."``); ``None`` = from ``torch.cuda.get_device_properties``.

    Raises:
        ModuleNotFoundError: If ``nvidia-ml-py`` is not installed (``pip install lit_speed[gpu]``).
        ValueError: If ``every_s`` <= 0.

    Example::

        sampler = NvmlSampler(0, every_s=0.5); sampler.start()
        ...; metrics = summarize_gpu_samples(sampler.drain()); sampler.stop()
    """

    def __init__(self, device_index: int, every_s: float = 0.5, uuid: str | None = None) -> None:
        if every_s <= 0:
            raise ValueError(f"gpu_sample_every_s must be > 0 seconds, got {every_s}")
        try:
            import pynvml
        except ModuleNotFoundError as error:
            raise ModuleNotFoundError("GPU utilisation needs nvidia-ml-py: pip install 'lit_speed[gpu]' "
                                      "(or nvidia-ml-py), or set gpu_sample_every_s=null to log torch.cuda "
                                      "memory only") from error
        self._pynvml = pynvml
        self.device_index = device_index
        self.uuid = uuid
        self.errors = 0
        self._handle: Any = None
        self.every_s = every_s
        self._samples: list[dict[str, float]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                sample = read_nvml(self._pynvml, self._handle)
            except Exception:  # noqa: BLE001 - a monitor must not die mid-run; the count tells
                self.errors += 1
                continue
            with self._lock:
                self._samples.append(sample)

    def start(self) -> None:
        if self._thread is None:
            self._pynvml.nvmlInit()  # reference-counted by NVML; paired with nvmlShutdown in stop()
            uuid = self.uuid if self.uuid is not None else cuda_device_uuid(self.device_index)
            self._handle = nvml_handle(self._pynvml, self.device_index, uuid)
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="lit_speed-nvml", daemon=True)
            self._thread.start()

    def drain(self) -> list[dict[str, float]]:
        """Samples taken since the previous drain (always at least one fresh reading)."""
        with self._lock:
            samples, self._samples = self._samples, []
        return samples or [read_nvml(self._pynvml, self._handle)]

    @property
    def running(self) -> bool:
        """Whether the polling thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=2 * self.every_s + 1)
            self._thread = None
            try:
                self._pynvml.nvmlShutdown()
            except self._pynvml.NVMLError:
                pass
