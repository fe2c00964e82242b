"""ONNX Runtime I/O binding over numpy memory: what the ONNX Runtime backends share."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

_FLOAT8E4M3FN = 17  # onnx.TensorProto.FLOAT8E4M3FN (the runtime does not import onnx)


class Binding:
    """One graph run configuration: a session, the cache bound once, and output buffers allocated
    once for a fixed token count (tokens=None: ORT allocates outputs per run, for any chunk size).
    rows: the fixed number of logit rows (None: any, allocated per run)."""

    def __init__(self, session, cache_values, out_specs: list[tuple[str, tuple, np.dtype, str]], tokens: int | None,
                 rows: int | None = None, aliases: list[tuple[str, ort.OrtValue]] = ()):
        """aliases: outputs bound to an input's own memory (a fused kernel's in-place cache)."""
        self.session = session
        self.tokens = tokens
        self.binding = session.io_binding()
        for name, ov in cache_values:
            self.binding.bind_ortvalue_input(name, ov)
        for name, ov in aliases:
            self.binding.bind_ortvalue_output(name, ov)
        self.names = [name for name, *_ in out_specs]
        self.outputs: list[np.ndarray | None] = []
        self._ovs = []
        self.dynamic: list[str] = []  # outputs ORT allocates per run
        for name, shape, dtype, onnx_type in out_specs:  # bound in declared order: get_outputs() keeps it
            if tokens is None or ("rows" in shape and rows is None):
                self.dynamic.append(name)
                self.binding.bind_output(name, "cpu")
                self.outputs.append(None)
                continue
            arr = np.empty(tuple({"tokens": tokens, "rows": rows}.get(d, d) for d in shape), dtype=dtype)
            ov = ortvalue(arr, onnx_type)
            self.binding.bind_ortvalue_output(name, ov)
            self.outputs.append(arr)
            self._ovs.append(ov)

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        b = self.binding
        for name, value in inputs.items():
            b.bind_cpu_input(name, value)
        # Rebound every run: a binding keeps the OrtValues ORT allocated for the previous run,
        # whose shapes differ when the chunk size or the number of logit rows changes.
        for name in self.dynamic:
            b.bind_output(name, "cpu")
        self.session.run_with_iobinding(b)
        if not self.dynamic:
            return self.outputs
        got = b.get_outputs()  # in binding order (aliases first); fp8 comes back as its uint8 bytes
        skip = len(got) - len(self.outputs)
        return [got[skip + i].numpy() if a is None else a for i, a in enumerate(self.outputs)]


def ortvalue(array: np.ndarray, dtype: str) -> ort.OrtValue:
    """An OrtValue over `array`'s own memory (CPU: no copy). fp8 tensors live in uint8 arrays."""
    if dtype == "float8e4m3fn":
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array, _FLOAT8E4M3FN)
    return ort.OrtValue.ortvalue_from_numpy(array)


def adapter_inputs(zeros: dict[str, np.ndarray], inputs: dict[str, np.ndarray] | None) -> list[tuple[str, ort.OrtValue]]:
    """A switchable adapter's graph inputs as OrtValues over the given arrays (no copy), named and
    ordered as `zeros` (every lora input of the graph, all zeros: no adapter); None: the zeros."""
    feeds = zeros if inputs is None else inputs
    if set(feeds) != set(zeros):
        raise ValueError("adapter inputs must be exactly the graph's lora_a / lora_b inputs")
    return [(name, ortvalue(feeds[name], "float")) for name in zeros]
