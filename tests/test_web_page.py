"""The page `cabinlm serve` serves at /, in a real browser: Debian's Chromium, headless, driven by
Playwright (pointed at /usr/bin/chromium; Playwright's own browser download is never used), loading
the page from a real server process. What a person sees is checked: the streamed reply growing in
the chat, the live panel's plot over a 40-turn dialogue whose window turns over, seats side by side,
a frame sent with its turn, tool calls as cards, and the server's own error messages for bad input,
after which the page goes on working. Replies are compared with the library's, greedy.

Screenshots are saved under each test's tmp_path and their paths printed (pytest -s shows them);
pytest removes a passing test's tmp_path, so set CABINLM_SCREENSHOTS=DIR to keep them in DIR.

`make test` installs the browser (apt-get install chromium, as root: CI) and playwright (the dev
extra). Where either is missing and the run is not root, these tests skip and say why.
"""

from __future__ import annotations

import base64
import json
import os
import re
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from test_serve import DRIVER, LONG_MESSAGE, MODEL, NO_PROXY, Server, library  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
REPLY = 12  # max_tokens the page sends (its settings panel)
LONG_REPLY = 300  # a reply long enough to be seen arriving in pieces
TURN_MS = 60_000  # the longest a turn may take in the page


def browser_or_skip() -> None:
    missing = []
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("playwright (the dev extra: pip install -c constraints.txt -e '.[dev]')")
    if not os.access(CHROMIUM, os.X_OK):
        missing.append(f"{CHROMIUM} (Debian's chromium package)")
    if not missing:
        return
    why = "the browser tests need " + " and ".join(missing) + "; `make test` installs them where it runs as root"
    print(why)
    if os.geteuid() == 0 or os.environ.get("CI"):  # `make test` installs both here: missing is a failure
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="module")
def browser():
    browser_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield b
        b.close()


@pytest.fixture
def shots(tmp_path) -> Path:
    kept = os.environ.get("CABINLM_SCREENSHOTS")
    folder = Path(kept) if kept else tmp_path / "screenshots"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def tiny_fused(load, tiny_qwen2_dir, export_to, tmp_path_factory) -> Path:
    """The suite's tiny Qwen2 (window 40: it turns over within a few turns) on the fused cpu build."""
    from cabinlm.engines.build import build_artifact
    from cabinlm.profiles import load_profile

    art = export_to(load(str(tiny_qwen2_dir)), sink=4, pinned=28, window=40, chunk=8, kv="int8")
    return build_artifact(art, load_profile("cpu"), tmp_path_factory.mktemp("web-fused") / "build-cpu")


@pytest.fixture(scope="module")
def served(tiny_fused, tmp_path_factory):
    with Server(tiny_fused, tmp_path_factory.mktemp("web") / "server.log", "--seats", 2) as s:
        yield s


@pytest.fixture(autouse=True)
def free_seats(request):
    """Each test on the shared server starts with every seat free."""
    if "served" in request.fixturenames:
        s = request.getfixturevalue("served")
        for seat in s.request("GET", "/v1/seats")[1]["data"]:
            s.request("DELETE", f"/v1/seats/{seat['name']}")
    yield


class Page:
    """One browser tab on a server's page."""

    def __init__(self, browser, server: Server, shots: Path, width: int = 1280, height: int = 720):
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.page = self.context.new_page()
        self.page.set_default_timeout(TURN_MS)
        self.shots = shots
        self.script_errors: list[str] = []
        self.page.on("pageerror", lambda e: self.script_errors.append(str(e)))
        self.page.goto(server.url + "/")
        self.page.wait_for_function("() => window.cabinlm.model !== null && window.cabinlm.samples.length > 0")

    def settings(self, max_tokens: int = REPLY, tools: list | None = None, tool_choice: str = "auto") -> None:
        p = self.page
        p.click("#settings-toggle")
        p.fill("#set-max-tokens", str(max_tokens))
        p.fill("#set-tools", json.dumps(tools) if tools else "")
        p.select_option("#set-tool-choice", tool_choice)
        p.click("#settings-apply")
        assert p.is_hidden("#settings"), p.inner_text("#settings-error")

    def seat(self, name: str) -> None:
        """Open a seat by name (the form), or switch to it (its button) when listed."""
        listed = self.page.locator(f'#seat-list button[data-seat="{name}"]')
        if listed.count():
            listed.click()
        else:
            self.page.fill("#seat-name", name)
            self.page.press("#seat-name", "Enter")
        assert self.page.inner_text("#seat-current") == name

    def send(self, text: str, frame: Path | None = None):
        """Type a message (and attach a frame) and send it; returns the entry that answered it: the
        assistant's reply, once done, or the error shown."""
        p = self.page
        before = p.locator("#messages .msg.assistant[data-state=done], #messages .msg.error").count()
        if frame is not None:
            p.set_input_files("#image-input", str(frame))
            p.wait_for_selector("#attached:not([hidden])")
        p.fill("#input", text)
        p.press("#input", "Enter")
        answered = p.locator("#messages .msg.assistant[data-state=done], #messages .msg.error")
        p.wait_for_function("n => document.querySelectorAll('#messages .msg.assistant[data-state=done], "
                            "#messages .msg.error').length > n", arg=before)  # fmt: skip
        return answered.nth(before)

    def samples(self) -> list[dict]:
        return self.page.evaluate("() => window.cabinlm.samples")

    def poll_after(self, answered: int) -> dict:
        """The live panel's first sample that counts `answered` requests answered."""
        self.page.wait_for_function("n => window.cabinlm.samples.some(s => s.answered >= n)", arg=answered)
        return next(s for s in self.samples() if s["answered"] >= answered)

    def shot(self, name: str) -> Path:
        path = self.shots / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        print(f"screenshot: {path}")
        return path

    def no_sideways_scroll(self) -> None:
        width, scroll = self.page.evaluate("() => [window.innerWidth, document.documentElement.scrollWidth]")
        assert scroll <= width, f"the page is {scroll} px wide in a {width} px viewport"

    def close(self) -> None:
        self.context.close()
        assert not self.script_errors, self.script_errors


def api_error(server: Server, body: dict) -> str:
    """The message of the error the server gives to this request sent by another client."""
    status, error = server.request("POST", "/v1/chat/completions", {"model": MODEL, **body})
    assert status >= 400, error
    return error["error"]["message"]


def test_a_streamed_reply_and_a_memory_plot_that_stays_flat_over_40_turns(served, tiny_fused, browser, shots):
    page = Page(browser, served, shots)
    p = page.page
    assert p.is_hidden("#image-button")  # a text-only model: no frame button
    page.settings(max_tokens=LONG_REPLY)
    page.seat("driver")
    plot_before = p.evaluate("() => document.getElementById('plot-cache').toDataURL()")
    # Watch the reply as the browser renders it: a streamed reply shows its text in growing pieces. The
    # tiny model writes its reply in milliseconds, so this one turn goes over a slow link (Chromium's
    # network emulation), as a phone's might be: the pieces then arrive over a second or so.
    cdp = page.context.new_cdp_session(p)
    cdp.send("Network.enable")
    cdp.send("Network.emulateNetworkConditions", {"offline": False, "latency": 0, "downloadThroughput": 16_000,
                                                  "uploadThroughput": -1})  # fmt: skip
    p.evaluate("""() => { window.seen = []; new MutationObserver(() => {
        const all = document.querySelectorAll('#messages .msg.assistant .text');
        const text = all.length ? all[all.length - 1].textContent : '';
        if (text && text !== window.seen.at(-1)) window.seen.push(text);
      }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true}); }""")
    reply = page.send(DRIVER[0])
    d = library(tiny_fused, max_new_tokens=LONG_REPLY)
    expected = d.ask(DRIVER[0])
    final = reply.locator(".text").text_content()
    assert final.strip() == expected.reply.strip() and expected.new_tokens > 100, expected
    partial = [t for t in p.evaluate("() => window.seen") if t != final]
    assert len(partial) >= 2 and all(final.startswith(t) for t in partial), (partial, final)
    cdp.send("Network.emulateNetworkConditions", {"offline": False, "latency": 0, "downloadThroughput": -1,
                                                  "uploadThroughput": -1})  # fmt: skip
    page.settings(max_tokens=REPLY)
    assert re.search(r"\d+ tokens · [\d.]+ tok/s · cache \d+ · evicted \d+", reply.locator(".meta").inner_text())
    page.shot("first-reply-1280x720")

    # 40 turns: the tiny window (40 tokens) turns over again and again
    rss_at: dict[int, float] = {}
    for i in range(1, 40):
        reply = page.send(DRIVER[i % len(DRIVER)])
        assert reply.get_attribute("data-state") == "done", reply.inner_text()
        if i in (10, 39):
            rss_at[i] = page.poll_after(i + 1)["rss"]
    last = page.poll_after(40)
    seat = last["seats"]["driver"]
    assert seat["turns"] == 40 and seat["evicted"] > 10 * 40, seat
    status, listed = served.request("GET", "/v1/seats/driver")
    assert (seat["cache"], seat["evicted"]) == (listed["cache_tokens"], listed["evicted_tokens"])
    samples = page.samples()
    caches = [s["seats"]["driver"]["cache"] for s in samples if "driver" in s["seats"]]
    assert max(caches) <= last["slots"]  # the cache never holds more than its slots
    evicted = [s["seats"]["driver"]["evicted"] for s in samples if "driver" in s["seats"]]
    assert evicted == sorted(evicted) and evicted[-1] > evicted[0]
    # flat: the process grew by less than 16 MiB over the last 29 turns
    grown = (rss_at[39] - rss_at[10]) / 2**20
    assert grown < 16, f"RSS grew by {grown:.1f} MiB from turn 11 to turn 40"
    assert p.inner_text("#now tbody").split()[:5] == ["driver", "40", str(seat["cache"]), str(seat["evicted"]),
                                                       str(seat["tok_s"])]  # fmt: skip
    assert p.evaluate("() => document.getElementById('plot-cache').toDataURL()") != plot_before
    page.shot("40-turns-1280x720")
    page.no_sideways_scroll()
    page.close()


def test_seats_side_by_side_each_keeps_its_chat_also_at_a_phone_width(served, tiny_fused, browser, shots):
    page = Page(browser, served, shots, width=390, height=844)
    p = page.page
    page.settings(max_tokens=REPLY)
    art = tiny_fused
    page.seat("front")
    front = page.send(DRIVER[0]).locator(".text").inner_text()
    page.seat("rear")
    assert p.locator("#messages .msg").count() == 0  # a seat of its own, its own chat
    rear = page.send("take a break").locator(".text").inner_text()
    assert rear.strip() == library(art, REPLY).ask("take a break").reply.strip()
    page.seat("front")
    assert p.locator("#messages .msg.assistant").first.locator(".text").inner_text() == front
    second = page.send(DRIVER[1]).locator(".text").inner_text()
    d = library(art, REPLY)
    d.ask(DRIVER[0])
    assert second.strip() == d.ask(DRIVER[1]).reply.strip()  # the seat went on from where it was
    page.poll_after(3)
    p.wait_for_function("() => document.querySelectorAll('#now tbody tr').length === 2")
    names = p.locator("#seat-list button").all_inner_texts()
    assert any("front" in n and "2 turns" in n for n in names) and any("rear" in n and "1 turns" in n for n in names)
    page.no_sideways_scroll()
    page.shot("seats-390x844")
    p.set_viewport_size({"width": 1280, "height": 720})
    page.no_sideways_scroll()
    page.shot("seats-1280x720")
    page.close()


def test_bad_input_shows_the_servers_error_and_the_page_goes_on(tiny_fused, browser, shots, tmp_path):
    with Server(tiny_fused, tmp_path / "server.log", "--seats", 1) as server:
        page = Page(browser, server, shots)
        p = page.page
        page.settings(max_tokens=REPLY)
        # a client-side mistake is said in the settings panel, nothing is sent
        p.click("#settings-toggle")
        p.fill("#set-tools", "[{not json")
        p.click("#settings-apply")
        assert "not JSON" in p.inner_text("#settings-error") and p.is_visible("#settings")
        p.fill("#set-tools", "")
        p.click("#settings-apply")

        page.seat("a")
        error = page.send(LONG_MESSAGE)  # more than the window holds
        expected = api_error(server, {"messages": [{"role": "user", "content": LONG_MESSAGE}], "user": "a"})
        assert error.locator(".message").inner_text() == expected and "(context_length_exceeded)" in error.inner_text()
        assert page.send(DRIVER[0]).get_attribute("data-state") == "done"  # the page goes on

        page.seat("b")  # one seat, and "a" holds it
        error = page.send(DRIVER[0])
        expected = api_error(server, {"messages": [{"role": "user", "content": DRIVER[0]}], "user": "b"})
        assert error.locator(".message").inner_text() == expected and "Error 503 (seats_full)" in error.inner_text()
        page.shot("seats-full-1280x720")

        page.seat("a")
        p.click("#seat-free")
        p.wait_for_function("() => !window.cabinlm.seats.some(s => s.name === 'a')")
        page.seat("b")
        reply = page.send(DRIVER[0])
        assert reply.locator(".text").inner_text().strip() == library(tiny_fused, REPLY).ask(DRIVER[0]).reply.strip()
        # the history the page sends for "b" holds only what was answered: the refused message is not in it
        sent = p.evaluate("() => window.cabinlm.chats.get('b').messages.map(m => m.role)")
        assert sent == ["user", "assistant"]

        page.seat("bad name!")
        error = page.send("hello")
        assert "user names the seat" in error.locator(".message").inner_text()
        page.close()


def test_markdown_is_rendered_after_html_is_escaped(served, browser, shots):
    page = Page(browser, served, shots)
    html = page.page.evaluate("""() => window.cabinlm.markdown(
        "<img src=x onerror=alert(1)> **bold** and `<b>code</b>`\\n- one\\n- two\\n```\\n<script>x()</script>\\n```")""")
    assert "<img" not in html and "<script" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
    assert "<strong>bold</strong>" in html and "<code>&lt;b&gt;code&lt;/b&gt;</code>" in html
    assert "<ul><li>one</li><li>two</li></ul>" in html and "<pre><code>&lt;script&gt;x()&lt;/script&gt;\n</code></pre>" in html
    page.close()


def test_a_frame_goes_with_its_turn_to_a_vision_language_build(browser, load, export_to, tiny_qwen2_vl_dir, tmp_path,
                                                               shots):  # fmt: skip
    from PIL import Image

    from test_vision import write_png_bomb

    art = export_to(load(str(tiny_qwen2_vl_dir)), sink=4, pinned=12, window=64, chunk=16)
    frame = tmp_path / "frame.png"
    Image.fromarray((np.random.default_rng(1).random((40, 52, 3)) * 255).astype("uint8")).save(frame)
    d = library(art, REPLY)
    expected = [d.ask("what is ahead", image=frame).reply, d.ask("and now").reply]
    with Server(art, tmp_path / "server.log", model="qwen2-vl") as server:
        page = Page(browser, server, shots)
        p = page.page
        assert p.is_visible("#image-button")
        page.settings(max_tokens=REPLY)
        page.seat("driver")
        reply = page.send("what is ahead", frame=frame)
        assert reply.locator(".text").inner_text().strip() == expected[0].strip()
        shown = p.locator("#messages .msg.user img.frame")
        assert shown.count() == 1
        sent = base64.b64decode(shown.get_attribute("src").split(",", 1)[1])
        assert sent == frame.read_bytes()  # the frame beside its turn is the one sent
        assert p.is_hidden("#attached")  # and it went with that turn only
        # a frame too large to decode: the server's reason, and the page goes on
        bomb = write_png_bomb(tmp_path / "bomb.png", 9000, 9000)
        error = page.send("and this one", frame=bomb)
        assert "decompression bomb" in error.locator(".message").inner_text() and "(invalid_image)" in error.inner_text()
        reply = page.send("and now")
        assert reply.locator(".text").inner_text().strip() == expected[1].strip()
        page.shot("frame-1280x720")
        page.close()


def test_tool_calls_are_cards_and_their_results_go_back(browser, load, export_to, tmp_path_factory, shots):
    from cabinlm.engines.build import build_artifact
    from cabinlm.profiles import load_profile
    from conftest import make_tiny_model
    from test_tool_calls import ASK, TOOLS, check_call

    source = make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-long"), "qwen2", max_position_embeddings=2048)
    art = export_to(load(str(source)), sink=4, pinned=1400, window=256, chunk=16, kv="int8")
    built = build_artifact(art, load_profile("cpu"), tmp_path_factory.mktemp("web-tools") / "build-cpu")
    with Server(built, tmp_path_factory.mktemp("web-tools-server") / "server.log") as server:
        body = {"messages": [{"role": "user", "content": ASK}], "tools": TOOLS, "tool_choice": "required",
                "max_tokens": 200, "user": "other"}  # fmt: skip
        status, answer = server.request("POST", "/v1/chat/completions", {"model": MODEL, **body})
        assert status == 200, answer
        calls = answer["choices"][0]["message"]["tool_calls"]
        server.request("DELETE", "/v1/seats/other")

        page = Page(browser, server, shots)
        p = page.page
        page.settings(max_tokens=200, tools=TOOLS, tool_choice="required")
        page.seat("driver")
        reply = page.send(ASK)
        cards = reply.locator(".card")
        assert cards.count() == len(calls) >= 1
        for i, call in enumerate(calls):
            name, args = cards.nth(i).locator(".name").inner_text(), cards.nth(i).locator(".args").inner_text()
            check_call(name, args)
            assert (name, json.loads(args)) == (call["function"]["name"], json.loads(call["function"]["arguments"]))
        page.shot("tool-calls-1280x720")
        page.settings(max_tokens=REPLY, tools=TOOLS, tool_choice="none")
        before = p.locator("#messages .msg.assistant[data-state=done]").count()
        reply.locator(".send-results").click()
        p.wait_for_function("n => document.querySelectorAll('#messages .msg.assistant[data-state=done]').length > n",
                            arg=before)  # fmt: skip
        roles = p.evaluate("() => window.cabinlm.chats.get('driver').messages.map(m => m.role)")
        assert roles == ["user", "assistant"] + ["tool"] * len(calls) + ["assistant"]
        assert p.locator("#messages .card.result").count() == len(calls)
        page.close()


@pytest.mark.slow
def test_the_default_smollm2_build_answers_in_the_page(smollm2_fused, browser, shots, tmp_path):
    with Server(smollm2_fused, tmp_path / "server.log", model="smollm2-135m", start_s=180) as server:
        page = Page(browser, server, shots)
        page.settings(max_tokens=24)
        page.seat("driver")
        reply = page.send("What is the capital of France?")
        assert "Paris" in reply.locator(".text").inner_text()
        assert page.page.inner_text("#model").startswith("smollm2-135m · onnxruntime")
        page.poll_after(1)
        page.shot("smollm2-1280x720")
        page.close()


def test_the_page_and_its_files_are_served_with_a_policy_that_runs_only_them(served):
    with NO_PROXY.open(urllib.request.Request(served.url + "/"), timeout=30) as r:
        html = r.read().decode()
        assert r.headers["Content-Type"].startswith("text/html")
        assert "script-src 'self'" in r.headers["Content-Security-Policy"]
    for asset in re.findall(r'(?:src|href)="(/static/[^"]+)"', html):
        with NO_PROXY.open(urllib.request.Request(served.url + asset), timeout=30) as r:
            assert r.status == 200 and r.read()
