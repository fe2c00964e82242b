"""The engines: one folder each (spec.py, builder.py, backend.py), listed in registry.py.

    engines/
      registry.py      BackendKind -> engine folder; open_backend
      backend.py       Backend: what the runtime's Decoder asks of an engine (runtime side)
      builder.py       Builder: check -> build -> BuildSpec (build side); BuildRequest, BuildError
      build.py         `cabinlm build`: the profile's engine chosen, the output folder written (output.py)
      onnxruntime/     what the ONNX Runtime engines share: sessions, bindings, offline optimization
      ort_graph/  ort_static/  ort_fused/  qnn_htp/  tensorrt/

This package imports nothing itself: the runtime loads an engine's backend without its builder.
"""
