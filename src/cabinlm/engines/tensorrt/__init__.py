"""tensorrt: the TensorRT compatibility check, the target bundle, the engine and its runtime (docs/tensorrt.md)."""
