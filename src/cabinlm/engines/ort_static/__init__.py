"""onnxruntime-static: a prefill graph (tokens = chunk) and a decode graph (tokens = 1) over one weights file."""
