"""`cabinlm serve`: the assistant as a local HTTP service (OpenAI chat completions; seats; sessions)."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Optional

import typer

from cabinlm.cli.common import info
from cabinlm.contract.errors import CabinlmError
from cabinlm.runtime.dialogue import LongMessages


def serve(
    artifact: Path = typer.Argument(..., help="Folder written by `cabinlm export` or `cabinlm build`."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (loopback by default: the car's own apps)."),
    port: int = typer.Option(8000, help="TCP port."),
    seats: int = typer.Option(1, help="Conversations held at once (a request's `user` names one); weights held once."),
    sessions: Optional[Path] = typer.Option(
        None, help="Folder: every seat saved after each turn, and resumed when the server starts again."
    ),
    max_new_tokens: int = typer.Option(256, help="A reply's limit when the request sets no max_tokens."),
    threads: Optional[int] = typer.Option(None, help="ONNX Runtime intra-op threads (default: all cores)."),
    long_messages: LongMessages = typer.Option(
        LongMessages.REFUSE,
        help="A message longer than the window: 'refuse' it (400), or 'stream' it through the window.",
    ),
    max_prompt_tokens: Optional[int] = typer.Option(
        None, help="The most tokens one request may have fed before its reply: its new messages, or its whole "
        "history when its seat starts over. More is refused (400) before it takes a seat or the model. "
        "[default: 4 windows]"),
    model_name: Optional[str] = typer.Option(
        None, help="The name clients send as `model` (default: the exported model's)."
    ),
    speculative: Optional[bool] = typer.Option(
        None, "--speculative/--no-speculative",
        help="Draft reply tokens by prompt lookup and check them in one step, as `cabinlm chat` does: the same "
        "replies (greedy) or the same distribution (sampled). [default: on for the fused cpu build]",
    ),
    recall: bool = typer.Option(
        True, "--recall/--no-recall",
        help="With an artifact exported with --recall R: each seat archives what leaves its window and recalls what "
        "is relevant before each message; usage.cabinlm.recall says what. --no-recall: StreamingLLM exactly."),
    recall_archive_mb: float = typer.Option(16.0, help="Largest archive of what left the window, per seat, in MB."),
    no_ui: bool = typer.Option(
        False, "--no-ui", help="Serve no page at / (then a 404): the API and /metrics only."
    ),
) -> None:
    """Serve an exported model over HTTP: POST /v1/chat/completions (OpenAI's API, streaming or not),
    GET /v1/models, GET /health, GET/DELETE /v1/seats, GET /v1/metrics.json and GET /metrics
    (Prometheus), and a chat page at / (seats, frames, tool calls, a live memory plot; --no-ui
    leaves it out). Requests run one token at a time in turns
    across seats; on a fused cpu build with batched graphs the seats' tokens run together, one graph
    run for up to 4 seats, each seat's drafts (--speculative) verified in the same runs. A new
    conversation when every seat is taken gets a 503."""
    try:
        from cabinlm.serve.app import run_server
    except ImportError as e:
        raise CabinlmError(f"cabinlm serve needs the web stack: pip install 'cabinlm[serve]' ({e})") from e
    from cabinlm.runtime.limits import check_count
    from cabinlm.serve import ChatService, ServeConfig

    # Every option is checked before the model loads, with `cabinlm chat`'s checks (runtime.limits):
    # the values by ServeConfig, the seats against this machine's memory by ChatService.open before
    # it opens the artifact. One line, exit 2.
    check_count("port", port, 0, 65535)
    config = ServeConfig(artifact, seats=seats, sessions=sessions, max_new_tokens=max_new_tokens, threads=threads,
                         long_messages=long_messages, model_id=model_name, speculative=speculative,
                         max_prompt_tokens=max_prompt_tokens, recall=recall,
                         recall_archive_mb=recall_archive_mb)  # fmt: skip
    service = ChatService.open(config)
    if service.resumed:
        info(f"resumed {len(service.resumed)} seats from {sessions}: {', '.join(service.resumed)}")
    if not _loopback(host):
        info(f"note: listening on {host}, not loopback: any machine that reaches it can talk to the model and "
             "have it read image files by path")  # fmt: skip
    info(f"serving {service.model_id} ({service.device}) on http://{host}:{port}/v1 with {seats} seats"
         + ("" if no_ui else f"; the page is at http://{host}:{port}/"))
    run_server(service, host, port, ui=not no_ui)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
