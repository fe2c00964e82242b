"""OpenAI response bodies: a chat completion, its streamed chunks, the usage block, the models list.

usage:
    prompt_tokens      tokens this request fed before the reply: the new messages (and the closing
                       tokens of the previous reply), or the whole history when the seat started over.
                       Not the length of the history: a seat that holds it feeds only what is new
    completion_tokens  the reply's tokens
    cabinlm            what else the turn did: the seat, the backend that ran it (Decoder.device),
                       "extended" or "rebuilt", exchanges fed again, the cache's occupancy and evictions
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from cabinlm.runtime.sampler import TokenScore
from cabinlm.serve.turns import TurnOutcome


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(outcome: TurnOutcome, seat: str) -> dict[str, Any]:
    r, plan = outcome.result, outcome.plan
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": r.new_tokens,
        "total_tokens": outcome.prompt_tokens + r.new_tokens,
        "cabinlm": {
            "seat": seat,
            "backend": r.backend,
            "history": plan.kind,
            "fed_again": (plan.keep if plan.rebuild else 0) + len(plan.given),  # earlier exchanges fed this request
            "turn": r.turn,
            "cache_tokens": r.cache_tokens,
            "evicted_tokens": r.evicted_tokens,
            "cache_bytes": r.cache_bytes,
            "prefill_tok_s": r.prefill_tok_s,
            "decode_tok_s": r.decode_tok_s,
            "drafted_tokens": r.drafted_tokens,  # speculative decoding (prompt lookup): drafted, then accepted
            "accepted_tokens": r.accepted_tokens,
            # the recall region this turn: {"turns", "tokens", "refreshed", "prefill_ms", "retrieval_ms"}, or null
            "recall": r.recall,
            "saved": outcome.saved,
        },
    }


def _finish(outcome: TurnOutcome) -> str:
    if outcome.calls and outcome.result.finish != "length":  # cut by the length limit after whole calls: "length"
        return "tool_calls"
    return "length" if outcome.result.finish == "length" else "stop"


def message(outcome: TurnOutcome) -> dict[str, Any]:
    """The reply as OpenAI's assistant message: its text, or its tool calls (content null where the
    model wrote nothing before them)."""
    if not outcome.calls:
        return {"role": "assistant", "content": outcome.result.reply}
    return {"role": "assistant", "content": outcome.content or None, "tool_calls": [c.to_dict() for c in outcome.calls]}


def call_piece(kind: str, index: int, value: str) -> dict[str, Any]:
    """A streamed piece of a tool call (turns.answer's on_call) as OpenAI streams it: the first delta
    of a call carries its index, id, type and name with empty arguments ("call": value "ID NAME"),
    the next ones the arguments' text ("args")."""
    if kind == "call":
        call_id, name = value.split(" ", 1)
        return {"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                "function": {"name": name, "arguments": ""}}]}  # fmt: skip
    return {"tool_calls": [{"index": index, "function": {"arguments": value}}]}


def call_deltas(outcome: TurnOutcome, streamed: dict[int, str] | None = None) -> list[dict[str, Any]]:
    """What of the reply's tool calls a stream has not sent yet (streamed: index -> the arguments
    sent for each call announced), as OpenAI streams them: per call not announced, its index, id,
    type and name with empty arguments, then the arguments (or the rest of them)."""
    streamed = streamed or {}
    out: list[dict[str, Any]] = []
    for i, c in enumerate(outcome.calls):
        if i not in streamed:
            out.append({"tool_calls": [{"index": i, "id": c.id, "type": "function",
                                        "function": {"name": c.name, "arguments": ""}}]})  # fmt: skip
        sent = streamed.get(i, "")
        rest = c.arguments[len(sent):] if c.arguments.startswith(sent) else ""
        if rest:
            out.append({"tool_calls": [{"index": i, "function": {"arguments": rest}}]})
    return out


def logprobs(scores: Sequence[TokenScore], describe: Callable[[int], tuple[str, bytes | None]]) -> dict[str, Any]:
    """Tokens' scores as OpenAI's choice.logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}.
    describe: a token id -> (its text, its bytes or None), ChatService.token_bytes (a piece of a
    character that spans tokens shows as U+FFFD in the text; the bytes hold it exactly)."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text, raw = describe(token)
        return {"token": text, "logprob": logprob, "bytes": None if raw is None else list(raw)}

    content = [{**entry(s.token, s.logprob), "top_logprobs": [entry(t, lp) for t, lp in s.top]} for s in scores]
    return {"content": content, "refusal": None}


def completion(cid: str, model: str, outcome: TurnOutcome, usage_block: dict,
               token_bytes: Callable[[int], tuple[str, bytes | None]] | None = None) -> dict[str, Any]:  # fmt: skip
    """token_bytes: how the outcome's logprobs name their tokens (where the request asked for them)."""
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": outcome.result.backend,
        "choices": [{
            "index": 0,
            "message": message(outcome),
            "finish_reason": _finish(outcome),
            "logprobs": None if outcome.logprobs is None or token_bytes is None
            else logprobs(outcome.logprobs, token_bytes),
        }],
        "usage": usage_block,
    }  # fmt: skip


def chunk(cid: str, model: str, created: int, delta: dict | None = None, finish: str | None = None,
          usage_block: dict | None = None, scores: dict | None = None) -> dict[str, Any]:  # fmt: skip
    """One streamed chunk: a delta (choices [one]) with the logprobs of its tokens (scores: logprobs()'s
    object), or with usage_block the final usage chunk (choices [])."""
    body: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
    if usage_block is not None:
        body["choices"], body["usage"] = [], usage_block
    else:
        body["choices"] = [{"index": 0, "delta": delta or {}, "finish_reason": finish, "logprobs": scores}]
    return body


def final_chunk(cid: str, model: str, created: int, outcome: TurnOutcome, scores: dict | None = None) -> dict[str, Any]:
    return chunk(cid, model, created, {}, _finish(outcome), scores=scores)


def models(model_ids, created: float, backend: str) -> dict[str, Any]:
    """model_ids: the base model's id, then BASE:NAME for each switchable adapter (schema.served_models)."""
    ids = [model_ids] if isinstance(model_ids, str) else list(model_ids)
    return {"object": "list", "data": [model(m, created, backend) for m in ids]}


def model(model_id: str, created: float, backend: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": int(created), "owned_by": f"cabinlm ({backend})"}
