"""The on-car runtime: numpy, onnxruntime and tokenizers only (never torch or transformers).

open_runtime(RuntimeConfig(...)) is how the commands open an artifact (runtime/assembly.py: every
check, then the seats' decoders and dialogues); open_artifact (runtime/artifact.py) loads one decoder
and the tokenizer."""

from __future__ import annotations

from cabinlm.contract.manifest import Manifest, load_manifest
from cabinlm.engines.backend import Backend, BackendError
from cabinlm.runtime.decoder import Decoder, seats_together, step_seats
from cabinlm.runtime.dialogue import Dialogue, TurnResult
from cabinlm.runtime.perplexity import PerplexityResult, stream_perplexity, token_nll
from cabinlm.runtime.sampler import Sampler
from cabinlm.contract.slots import SlotTable, StepPlan
from cabinlm.runtime.tokenizer import StreamDecoder, Tokenizer
from cabinlm.runtime.artifact import open_artifact
from cabinlm.runtime.assembly import Runtime, RuntimeConfig, open_runtime


__all__ = [
    "Backend",
    "BackendError",
    "Decoder",
    "Dialogue",
    "Manifest",
    "PerplexityResult",
    "Runtime",
    "RuntimeConfig",
    "Sampler",
    "SlotTable",
    "StepPlan",
    "StreamDecoder",
    "Tokenizer",
    "TurnResult",
    "load_manifest",
    "open_artifact",
    "open_runtime",
    "seats_together",
    "step_seats",
    "stream_perplexity",
    "token_nll",
]
