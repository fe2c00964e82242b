"""Input lines a hostile (or broken) front end sends, generated: every line is either a message for
the seat its sender named, or one InputError of one printable line; never another exception, and
never a message delivered to a seat it was not meant for.

Each class of line is its own property, so that a failure names the class: arbitrary Unicode
(surrogates included), JSON messages with arbitrary text, numbers of thousands of digits, nesting
hundreds of thousands deep, JSON objects of any shape, and JSON messages cut short. A list of
examples (tests/test_sessions.py) could not tell a parser that refuses a bad seat from one that
delivers it elsewhere for every value; these properties assert, for each generated line, exactly
what must come out.
"""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cabinlm.contract.errors import InputError
from cabinlm.runtime.inputs import UserInput, parse_input_line

SEATS = 3
EXAMPLES = 400  # per class; hypothesis stops early only when a class has fewer distinct lines
CHARS = st.one_of(st.characters(), st.characters(categories=["Cs"]), st.sampled_from("@{}[]\":, 0123456789\n\t\x00"))
hostile = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def parse(line: str) -> UserInput | None:
    """parse_input_line, which may only return a deliverable message or raise one InputError of one
    printable line (any other exception fails the test). None: refused."""
    try:
        got = parse_input_line(line, seats=SEATS)
    except InputError as e:
        msg = str(e)
        assert msg and "\n" not in msg and len(msg) <= 300, msg
        msg.encode("utf-8")  # printable: no lone surrogate reaches the terminal
        return None
    assert isinstance(got, UserInput) and type(got.seat) is int and 1 <= got.seat <= SEATS
    got.text.encode("utf-8")
    assert got.text == got.text.strip()
    assert got.image is None or (isinstance(got.image, Path) and "\x00" not in str(got.image))
    return got


def unicode_ok(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def seat_ok(seat) -> bool:
    return type(seat) is int and 1 <= seat <= SEATS


def image_ok(image) -> bool:
    if image is None:
        return True
    return isinstance(image, str) and bool(image.strip()) and "\x00" not in image and unicode_ok(image)


@hostile
@given(st.text(CHARS, max_size=200))
def test_any_unicode_line_is_a_message_or_one_error(line):
    got = parse(line)
    if not unicode_ok(line):
        assert got is None  # a lone surrogate is not text a tokenizer or a terminal can take
    elif not line.strip().startswith(("@", "{")):
        assert got == UserInput(1, line.strip())


@hostile
@given(text=st.text(CHARS, max_size=80), seat=st.none() | st.integers(-2, SEATS + 2),
       image=st.none() | st.text(CHARS, max_size=20), ascii_only=st.booleans())  # fmt: skip
def test_a_json_message_is_delivered_to_its_seat_or_refused(text, seat, image, ascii_only):
    # ascii_only: lone surrogates travel as \udXXX escapes (what a JSON encoder writes), else raw
    obj = {"text": text}
    obj.update({"seat": seat} if seat is not None else {})
    obj.update({"image": image} if image is not None else {})
    got = parse(json.dumps(obj, ensure_ascii=ascii_only))
    if unicode_ok(text) and (seat is None or seat_ok(seat)) and image_ok(image):
        assert got == UserInput(seat or 1, text.strip(), Path(image) if image is not None else None)
    else:
        assert got is None


DIGITS = st.one_of(
    st.text("0123456789", min_size=1, max_size=30),
    st.builds(lambda d, n: d * n, st.sampled_from("0123456789"), st.integers(1, 20_000)),  # beyond int()'s 4300 digits
    st.builds(lambda n, tail: "1" + "0" * n + tail, st.integers(1, 12_000), st.text("0123456789", max_size=3)),
)
NUMBER_LINES = ["@{} hi", '{{"seat": {}, "text": "hi"}}', '{{"text": "hi", "seat": -{}}}',
                '{{"seat": {}.5, "text": "hi"}}', '{{"seat": {}e999, "text": "hi"}}', '{{"seat": 1e{}, "text": "hi"}}',
                '{{"seat": "{}", "text": "hi"}}', '{{"text": "hi", "image": {}}}', '{{"text": {}}}']  # fmt: skip


@hostile
@given(digits=DIGITS, form=st.sampled_from(NUMBER_LINES))
def test_numbers_of_thousands_of_digits_never_reach_another_seat(digits, form):
    got = parse(form.format(digits))
    significant = digits.lstrip("0") or "0"
    in_range = len(significant) <= 1 and 1 <= int(significant) <= SEATS
    if form == "@{} hi":
        assert got == (UserInput(int(significant), "hi") if in_range else None)
    elif form == '{{"seat": {}, "text": "hi"}}':  # JSON has no leading zeros: "07" is not a number
        assert got == (UserInput(int(significant), "hi") if in_range and digits == significant else None)
    else:  # a negative, fractional, overflowing or quoted seat, a number where a string belongs
        assert got is None


@hostile
@given(depth=st.integers(1, 200_000), where=st.sampled_from(["text", "seat", "image", "extra", "line"]),
       kind=st.sampled_from(["list", "object"]))  # fmt: skip
def test_nesting_hundreds_of_thousands_deep_is_one_error(depth, where, kind):
    if kind == "list":
        nested = "[" * depth + "]" * depth
    else:
        nested = '{"a": ' * depth + "1" + "}" * depth
    if where == "line":
        line = '{"a": ' * depth + '"hi"' + "}" * depth  # the message object itself, nested
    elif where == "text":
        line = f'{{"text": {nested}}}'
    else:
        line = f'{{"text": "hi", "{where}": {nested}}}'
    assert parse(line) is None  # a structure where text, seat or image belongs; an unknown key


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(CHARS, max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(CHARS, max_size=5), inner, max_size=3),
    max_leaves=8,
)
KEYS = st.sampled_from(["text", "seat", "image", "Text", "seats", "img", ""]) | st.text(CHARS, max_size=6)


@hostile
@given(obj=st.dictionaries(KEYS, JSON_VALUES, max_size=4), ascii_only=st.booleans())
def test_json_objects_of_any_shape_are_delivered_only_when_well_typed(obj, ascii_only):
    got = parse(json.dumps(obj, ensure_ascii=ascii_only))  # NaN and Infinity included, as json writes them
    text, seat, image = obj.get("text"), obj.get("seat", 1), obj.get("image")
    well_typed = set(obj) <= {"text", "seat", "image"} and isinstance(text, str) and unicode_ok(text)
    if well_typed and seat_ok(seat) and image_ok(image):
        assert got == UserInput(seat, text.strip(), Path(image) if image is not None else None)
    else:
        assert got is None


@hostile
@given(text=st.text(CHARS, max_size=40), seat=st.integers(2, SEATS), cut=st.floats(0, 1, exclude_max=True))
def test_a_json_message_cut_short_never_reaches_another_seat(text, seat, cut):
    whole = json.dumps({"seat": seat, "text": text, "image": "frame.png"})
    line = whole[: int(cut * len(whole))]
    got = parse(line)
    # What a cut line can still be: refused, or nothing but the bare "{" (no words of anybody's)
    assert got is None or got == UserInput(1, line.strip()) and line.strip() in ("", "{")
