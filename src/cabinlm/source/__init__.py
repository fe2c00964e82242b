"""The source model as its files describe it: the architecture from config.json or a GGUF header
(config.py) and the camera preprocessing from the processor config (processor.py). Standard library
only; the planner reads a model through it before any export, the export before it loads weights."""
