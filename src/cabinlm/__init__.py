"""cabinlm: constant-memory LLM/VLM dialogue for car-cockpit SoCs.

export (torch) -> manifest + fixed-shape ONNX graph -> runtime (numpy + onnxruntime).
"""

__version__ = "0.1.0"
