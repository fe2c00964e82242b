"""onnxruntime-graph: the exported graph (dynamic token count) on ONNX Runtime, as exported or optimized offline."""
