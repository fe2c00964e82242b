"""What the ONNX Runtime engines share: sessions as a build describes them, I/O bindings, offline graph work."""
