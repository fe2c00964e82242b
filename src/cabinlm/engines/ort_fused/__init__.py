"""onnxruntime-fused: the cpu build's fused decoder over a rotated cache, with cabinlm's own kernels (kernels/)."""
