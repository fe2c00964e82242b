"""qnn-htp: Snapdragon HTP context binaries compiled by Qualcomm's compiler through ONNX Runtime's QNN plugin."""
