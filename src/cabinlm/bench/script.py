"""The scripted dialogue every benchmark engine runs: in-car user turns, generated without end from
templates with a seeded generator, so cabinlm and each baseline see the same user text."""

from __future__ import annotations

import random
from typing import Iterator

SYSTEM = "You are the assistant of a car. Answer briefly and helpfully."

_TEMPLATES = [
    "How far is it to the next {place}?",
    "Set the temperature to {temp} degrees on the {side} side.",
    "What is the speed limit on the {road}?",
    "Play some {genre} music, please.",
    "Is there a traffic jam on the {road}?",
    "Remind me to call {name} when we reach {city}.",
    "Explain in a few sentences how {thing} works.",
    "Find a {place} near {city} that is open now.",
    "Read my last message from {name}.",
    "Tell me something interesting about {city}.",
    "Why is the {warning} warning light on?",
    "How much range do we have left, and where should we charge before {city}?",
]
_FILL = {
    "place": ["charging station", "petrol station", "rest area", "pharmacy", "bakery", "car park"],
    "temp": ["19", "20", "21", "22", "23"],
    "side": ["driver", "passenger", "rear"],
    "road": ["A8", "A9", "B318", "ring road", "coast road", "mountain pass"],
    "genre": ["calm", "jazz", "classical", "rock", "folk"],
    "name": ["Anna", "Mehmet", "Lucia", "Tom", "Yuki", "Priya"],
    "city": ["Munich", "Salzburg", "Verona", "Lyon", "Ghent", "Kraków"],
    "thing": ["regenerative braking", "adaptive cruise control", "a heat pump", "lane keeping", "tyre pressure monitoring"],
    "warning": ["tyre pressure", "engine", "battery", "brake", "lane assist"],
}


def user_turns(seed: int = 0) -> Iterator[str]:
    """An endless, reproducible stream of user messages."""
    rng = random.Random(seed)
    while True:
        template = rng.choice(_TEMPLATES)
        yield template.format(**{k: rng.choice(v) for k, v in _FILL.items()})
