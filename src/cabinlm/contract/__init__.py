"""The contract at the bottom: what export, build and runtime agree on, standard library only.

    manifest.py     the versioned artifact manifest (model, cache, I/O, build, files, quality)
    buildspec.py    what a build is: backend kind, provider, session settings, the engine's facts
    engines/        the backend kinds and each engine's typed build facts (build.<KEY>)
    layout.py       the cache geometry (sink | pinned | image | window ring)
    io_spec.py      the decoder graph's inputs and outputs, declared once
    slots.py        the slot bookkeeping every engine shares (numpy)
    precision.py    KV and weight precisions
    vision_spec.py  the camera encoder's preprocessing and output
    calibration.py  the calibration text the export and the builds share
    errors.py       the typed errors every layer raises

Layers point down only (tests/test_import_graph.py):
    contract <- source <- profiles <- engines <- runtime <- export, serve, bench <- cli
Nothing here imports another cabinlm package; slots.py alone uses numpy.
"""
