"""logprobs / top_logprobs in `cabinlm serve`, checked with the openai client: each returned token's
log probability is the log-softmax of the model's raw logits at its position, computed here again
from the runtime's own decoder steps; drafting (several tokens verified per step) reports for each
token the row of its own position; streams carry each delta's tokens.

The served model is the suite's tiny random-weight Qwen2 on the fused cpu build, greedy, one thread.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from cabinlm.engines.build import build_artifact  # noqa: E402
from cabinlm.profiles import load_profile  # noqa: E402
from cabinlm.runtime import open_artifact  # noqa: E402
from cabinlm.runtime.template import Template  # noqa: E402

MODEL = "tiny-qwen2"
# Repeated text: prompt-lookup drafts find what a random model echoes, so drafts are verified.
ASK = "check the route and the charging stations on the way; check the route and the charging stations"


@pytest.fixture(scope="module")
def artifact(load, export_to, tmp_path_factory) -> Path:
    from conftest import make_tiny_model

    source = make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-logprobs"), "qwen2")
    art = export_to(load(str(source)), sink=4, window=128, chunk=16, kv="int8")
    return build_artifact(art, load_profile("cpu"), tmp_path_factory.mktemp("logprobs") / "build-cpu")


def reference(artifact: Path, text: str, n: int) -> tuple[list[int], list[np.ndarray]]:
    """The greedy reply to `text` in a new seat, one decoder step per token (no drafting): its tokens
    and the numpy log-softmax of the raw logits each was chosen from."""
    dec, tok = open_artifact(artifact, threads=1, verify=False)
    template = Template(tok, dec.manifest.chat)
    dec.reset()
    start = template.start(dec.manifest.chat.default_system)
    if start:
        dec.feed(start, pin=True)
    logits = dec.feed(template.user(text))
    tokens, rows = [], []
    for _ in range(n):
        z = logits.astype(np.float64)
        rows.append(z - z.max() - np.log(np.exp(z - z.max()).sum()))
        tokens.append(int(np.argmax(logits)))
        if tokens[-1] in dec.manifest.stop_ids:
            break
        logits = dec.step(np.array([tokens[-1]], dtype=np.int64))[0]
    return tokens, rows


@pytest.fixture(scope="module")
def servers(artifact, tmp_path_factory):
    """The same artifact served with prompt-lookup drafting and without."""
    from test_serve import Server

    log = tmp_path_factory.mktemp("logprobs-server")
    with Server(artifact, log / "on.log", "--speculative", "--seats", 2, model=MODEL) as on, \
            Server(artifact, log / "off.log", "--no-speculative", "--seats", 2, model=MODEL) as off:  # fmt: skip
        yield {"on": on, "off": off}


@pytest.fixture(autouse=True)
def free_seats(servers):
    """Each test starts with every seat free."""
    yield
    for server in servers.values():
        for seat in server.request("GET", "/v1/seats")[1]["data"]:
            server.request("DELETE", f"/v1/seats/{seat['name']}")


def test_logprobs_are_the_models_log_softmax_at_each_position_with_and_without_drafting(servers, artifact):
    got = {}
    for name, server in servers.items():
        r = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                                    max_tokens=40, logprobs=True, top_logprobs=5, user=name)
        got[name] = r
        extra = r.usage.model_extra["cabinlm"]
        assert (extra["accepted_tokens"] > 0) == (name == "on"), extra  # drafts were verified and taken
    on, off = (got[k].choices[0] for k in ("on", "off"))
    assert on.message.content == off.message.content
    tokens, rows = reference(artifact, ASK, len(on.logprobs.content) + 1)
    assert len(on.logprobs.content) == got["on"].usage.completion_tokens
    tok_bytes = b"".join(bytes(e.bytes or b"") for e in on.logprobs.content)
    assert tok_bytes.decode("utf-8", "replace") == on.message.content  # the tokens' bytes are the reply
    for choice in (on, off):
        for i, e in enumerate(choice.logprobs.content):
            row = rows[i]
            assert e.logprob == pytest.approx(row[tokens[i]], abs=1e-4)
            assert len(e.top_logprobs) == 5
            # greedy: the chosen token is the likeliest, its logprob the top one's
            assert e.top_logprobs[0].logprob == e.logprob and e.top_logprobs[0].bytes == e.bytes
            assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
            best = np.sort(row)[::-1][:5]
            assert np.allclose([t.logprob for t in e.top_logprobs], best, atol=1e-4)
    for a, b in zip(on.logprobs.content, off.logprobs.content, strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-5)


def test_streamed_chunks_carry_the_logprobs_of_their_tokens(servers):
    server = servers["on"]
    client = server.client()
    kw = dict(model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=40, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(user="whole", **kw).choices[0]
    streamed, text = [], ""
    for chunk in client.chat.completions.create(user="streamed", stream=True, **kw):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        text += c.delta.content or ""
        if c.logprobs is not None:
            streamed += c.logprobs.content
            assert c.delta.content or c.finish_reason, c  # tokens ride with the text they made
        # each chunk's tokens are its own delta's: the bytes so far decode to the text so far
        got = b"".join(bytes(e.bytes or b"") for e in streamed)
        assert got.decode("utf-8", "replace").startswith(text) or text.startswith(got.decode("utf-8", "replace"))
    assert text == whole.message.content
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in whole.logprobs.content]  # fmt: skip


def test_a_stop_string_cuts_the_logprobs_with_the_text(servers):
    client = servers["off"].client()
    free = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=30,
                                          logprobs=True, user="free").choices[0]  # fmt: skip
    text = free.message.content
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=30,
                                         logprobs=True, stop=[stop], user="cut").choices[0]  # fmt: skip
    assert cut.message.content == text[: text.find(stop)]
    n = len(cut.logprobs.content)
    assert 0 < n < len(free.logprobs.content)
    assert [e.logprob for e in cut.logprobs.content] == [e.logprob for e in free.logprobs.content[:n]]
    joined = b"".join(bytes(e.bytes or b"") for e in cut.logprobs.content).decode("utf-8", "replace")
    assert joined.startswith(cut.message.content) and len(joined) < len(cut.message.content) + len(stop) + 8


def test_logprobs_off_by_default_and_bad_values_refused_naming_the_param(servers):
    server = servers["off"]
    r = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, user="plain")  # fmt: skip
    assert r.choices[0].logprobs is None
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "user": "bad"}
    for extra, param in [({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                         ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
                         ({"top_logprobs": 3}, "top_logprobs"),
                         ({"logprobs": "yes"}, "logprobs")]:  # fmt: skip
        status, error = server.request("POST", "/v1/chat/completions", {**base, **extra})
        assert status == 400 and error["error"]["param"] == param, error
        assert "\n" not in error["error"]["message"]
    status, body = server.request("POST", "/v1/chat/completions", {**base, "logprobs": True})
    assert status == 200 and all(e["top_logprobs"] == [] for e in body["choices"][0]["logprobs"]["content"])
