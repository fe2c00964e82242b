"""`cabinlm` command line: thin over the library. Library errors become one-line messages, exit 2.

    cli/export.py   export, profiles, plan    what to build, for which device
    cli/build.py    build                     an artifact -> what a device's engine loads
    cli/doctor.py   doctor                    a new NVIDIA board: TensorRT, CUDA, GPU, bundle, engine vs CPU
    cli/chat.py     chat                      the dialogue loop (ChatLoop)
    cli/serve.py    serve                     the assistant as a local HTTP service (cabinlm.serve)
    cli/measure.py  perplexity, fetch         measuring an artifact, getting a model
    cli/bench.py    bench                     a scripted dialogue timed, its records compared
    cli/common.py   messages, profiles by name, precision choices
"""

from __future__ import annotations

import sys

import typer

from cabinlm.cli import bench, build, chat, doctor, export, measure, recall, serve
from cabinlm.cli.common import err
from cabinlm.contract.errors import CabinlmError

app = typer.Typer(
    help=(
        "Constant-memory LLM dialogue for car-cockpit SoCs.\n\n"
        "  cabinlm export smollm2-135m -o out/smol     # sink + rolling-window ONNX graph\n\n"
        "  cabinlm chat out/smol                       # talk to it, at constant memory\n\n"
        "  cabinlm serve out/smol --seats 2            # OpenAI chat API on 127.0.0.1:8000\n\n"
        "  cabinlm perplexity out/smol --text book.txt # streaming quality"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
for command in (export.export, export.profiles, export.plan, build.build, doctor.doctor, chat.chat, serve.serve,
                measure.perplexity, bench.bench, measure.fetch, recall.recall):  # fmt: skip
    app.command()(command)


def main() -> None:
    try:
        app()
    except CabinlmError as e:
        err(str(e))
        sys.exit(2)
    except KeyboardInterrupt:
        err("interrupted")
        sys.exit(130)
