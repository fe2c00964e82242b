"""`cabinlm serve`: the assistant as a local service, OpenAI's chat-completions API over seats.

    schema.py     a request, checked once: JSON -> ChatRequest, or a RequestError (OpenAI's error object)
    conversation.py  its messages: the OpenAI messages list -> a Conversation (system, exchanges, prompt)
    request_error.py a refused request (RequestError: status, type, code, param) and the shared field checks
    admission.py  what a request would feed, measured before it may claim a seat or take the model
    history.py    what a seat holds (SeatRecord) and what a request's history asks of it (TurnPlan)
    images.py     image_url parts: data URLs and local files -> images for Dialogue.ask
    turns.py      one request's work on its seat, in a worker thread (replays, the answer, the record)
    (the seats' turns on the one loaded model, and their steps riding together: runtime/model_turns.py)
    seats.py      named seats and admission control
    store.py      --sessions DIR: each seat's session file and record, resumed at start
    service.py    the loaded model, its seats and worker threads: what the HTTP app calls
    replies.py    OpenAI response bodies and the usage block
    metrics.py    the live figures: GET /v1/metrics.json, and GET /metrics through prometheus_client
    app.py        the HTTP app (Starlette; uvicorn runs it), needs the [serve] extra
    web/          the page at / (plain HTML, JS and CSS over the public API; docs/serve-page.md)

Everything but app.py and metrics.py is plain Python over cabinlm.runtime.
"""

from cabinlm.serve.service import ChatService, ServeConfig

__all__ = ["ChatService", "ServeConfig"]
