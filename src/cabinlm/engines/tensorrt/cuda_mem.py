"""The few CUDA calls the TensorRT backend makes, behind one small interface with two
implementations: NVIDIA's `cuda-bindings` (cuda-python; `pip install cabinlm[tensorrt]`) first, and
`pycuda` where only it is installed (older DRIVE OS / JetPack images ship it). Neither is imported
until a TensorRT build is opened.

    dev = open_cuda()                        the primary context of GPU 0 (the one TensorRT uses)
    p = dev.alloc(n)                         device memory, freed with the object
    h = dev.host(n)                          page-locked host memory as a uint8 numpy array
    dev.htod(p, h[:k], s); dev.dtoh(h[:k], p, s); dev.copy_2d(dst, dpitch, src, spitch, w, rows, s)
    dev.sync(s)                              s = dev.stream: one stream per backend, an int handle

Every call checks its status and raises BackendError naming the call.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from cabinlm.engines.backend import BackendError


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    compute_capability: str  # "8.7"
    driver_version: str  # "12.6"
    library: str  # "cuda-bindings 13.5.0" | "pycuda 2022.2"
    total_bytes: int


class Cuda(Protocol):
    """What the backend needs from CUDA. Pointers and the stream are plain ints."""

    stream: int

    def info(self) -> DeviceInfo: ...
    def alloc(self, nbytes: int) -> int: ...
    def host(self, nbytes: int) -> np.ndarray: ...
    def htod(self, dst: int, src: np.ndarray, stream: int) -> None: ...
    def dtoh(self, dst: np.ndarray, src: int, stream: int) -> None: ...
    def copy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int) -> None: ...
    def memset(self, dst: int, nbytes: int, stream: int) -> None: ...
    def sync(self, stream: int) -> None: ...


def _version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


class CudaBindings:
    """cuda-bindings (cuda.bindings.driver; cuda-python < 12.6: cuda.cuda)."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver as cu  # type: ignore[import-untyped]
        except ImportError:
            from cuda import cuda as cu  # type: ignore[import-untyped,no-redef,attr-defined]
        self.cu = cu
        self._allocations: list[int] = []
        self._host: list[tuple[int, np.ndarray]] = []
        try:
            self._check(cu.cuInit(0), "cuInit")
        except RuntimeError as e:  # cuda.pathfinder: no driver library on this machine
            raise BackendError(f"CUDA driver not found ({e}); this machine has no NVIDIA driver") from e
        self.device = self._check(cu.cuDeviceGet(0), "cuDeviceGet")
        self.context = self._check(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self._check(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        stream = self._check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        self._stream = stream
        self.stream = int(stream)
        self._copy = cu.CUDA_MEMCPY2D()  # reused by every copy_2d

    def _check(self, result: Any, call: str) -> Any:
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != self.cu.CUresult.CUDA_SUCCESS:
            _, name = self.cu.cuGetErrorName(err)
            raise BackendError(f"CUDA {call} failed: {name.decode() if isinstance(name, bytes) else name}")
        return rest[0] if len(rest) == 1 else (tuple(rest) or None)

    def info(self) -> DeviceInfo:
        cu, dev = self.cu, self.device
        name = self._check(cu.cuDeviceGetName(256, dev), "cuDeviceGetName")
        attr = cu.CUdevice_attribute
        major = self._check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cuDeviceGetAttribute")
        minor = self._check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cuDeviceGetAttribute")
        total = self._check(cu.cuDeviceTotalMem(dev), "cuDeviceTotalMem")
        driver = self._check(cu.cuDriverGetVersion(), "cuDriverGetVersion")
        from cuda import bindings  # type: ignore[import-untyped]

        text = name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name)
        return DeviceInfo(text, f"{major}.{minor}", _version(int(driver)),
                          f"cuda-bindings {getattr(bindings, '__version__', '?')}", int(total))  # fmt: skip

    def alloc(self, nbytes: int) -> int:
        ptr = int(self._check(self.cu.cuMemAlloc(max(nbytes, 1)), "cuMemAlloc"))
        self._allocations.append(ptr)
        return ptr

    def host(self, nbytes: int) -> np.ndarray:
        ptr = int(self._check(self.cu.cuMemHostAlloc(max(nbytes, 1), 0), "cuMemHostAlloc"))
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr))[:nbytes]
        self._host.append((ptr, arr))
        return arr

    def htod(self, dst: int, src: np.ndarray, stream: int) -> None:
        self._check(self.cu.cuMemcpyHtoDAsync(dst, src.ctypes.data, src.nbytes, self._stream), "cuMemcpyHtoDAsync")

    def dtoh(self, dst: np.ndarray, src: int, stream: int) -> None:
        self._check(self.cu.cuMemcpyDtoHAsync(dst.ctypes.data, src, dst.nbytes, self._stream), "cuMemcpyDtoHAsync")

    def copy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int) -> None:
        cu, c = self.cu, self._copy
        c.srcMemoryType = c.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
        c.srcDevice, c.srcPitch, c.srcXInBytes, c.srcY = cu.CUdeviceptr(src), src_pitch, 0, 0
        c.dstDevice, c.dstPitch, c.dstXInBytes, c.dstY = cu.CUdeviceptr(dst), dst_pitch, 0, 0
        c.WidthInBytes, c.Height = width, height
        self._check(cu.cuMemcpy2DAsync(c, self._stream), "cuMemcpy2DAsync")

    def memset(self, dst: int, nbytes: int, stream: int) -> None:
        self._check(self.cu.cuMemsetD8Async(dst, 0, nbytes, self._stream), "cuMemsetD8Async")

    def sync(self, stream: int) -> None:
        self._check(self.cu.cuStreamSynchronize(self._stream), "cuStreamSynchronize")

    def __del__(self) -> None:  # best effort at exit; the process ending frees it all anyway
        cu = getattr(self, "cu", None)
        if cu is None:
            return
        for ptr in getattr(self, "_allocations", []):
            cu.cuMemFree(ptr)
        for ptr, _ in getattr(self, "_host", []):
            cu.cuMemFreeHost(ptr)


class PyCuda:
    """pycuda.driver, for images that ship pycuda and not cuda-python."""

    def __init__(self) -> None:
        import pycuda.driver as drv  # type: ignore[import-not-found]

        self.drv = drv
        try:
            drv.init()
            self.device = drv.Device(0)
            self.context = self.device.retain_primary_context()
            self.context.push()
            self._stream = drv.Stream()
        except drv.Error as e:
            raise BackendError(f"CUDA (pycuda) failed to start: {e}") from e
        self.stream = int(self._stream.handle)
        self._keep: list[Any] = []  # allocations live as long as this object

    def info(self) -> DeviceInfo:
        import pycuda  # type: ignore[import-not-found]

        major, minor = self.device.compute_capability()
        return DeviceInfo(self.device.name(), f"{major}.{minor}", _version(self.drv.get_driver_version()),
                          f"pycuda {pycuda.VERSION_TEXT}", int(self.device.total_memory()))  # fmt: skip

    def alloc(self, nbytes: int) -> int:
        a = self.drv.mem_alloc(max(nbytes, 1))
        self._keep.append(a)
        return int(a)

    def host(self, nbytes: int) -> np.ndarray:
        arr = self.drv.pagelocked_empty(max(nbytes, 1), np.uint8)[:nbytes]
        self._keep.append(arr)
        return arr

    def htod(self, dst: int, src: np.ndarray, stream: int) -> None:
        self.drv.memcpy_htod_async(dst, src, self._stream)

    def dtoh(self, dst: np.ndarray, src: int, stream: int) -> None:
        self.drv.memcpy_dtoh_async(dst, src, self._stream)

    def copy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int) -> None:
        c = self.drv.Memcpy2D()
        c.set_src_device(src)
        c.set_dst_device(dst)
        c.src_pitch, c.dst_pitch, c.width_in_bytes, c.height = src_pitch, dst_pitch, width, height
        c(self._stream)

    def memset(self, dst: int, nbytes: int, stream: int) -> None:
        self.drv.memset_d8_async(dst, 0, nbytes, self._stream)

    def sync(self, stream: int) -> None:
        self._stream.synchronize()


def open_cuda() -> Cuda:
    """cuda-bindings if installed, else pycuda; BackendError naming both when neither is."""
    import importlib.util

    if importlib.util.find_spec("cuda") is not None:
        try:
            return CudaBindings()
        except ImportError:
            pass  # a `cuda` namespace without the driver bindings: try pycuda
    if importlib.util.find_spec("pycuda") is not None:
        return PyCuda()
    raise BackendError("no CUDA Python bindings: install cuda-bindings (`pip install cabinlm[tensorrt]`) or pycuda")
