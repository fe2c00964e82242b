"""A vehicle simulator for the tool-calling demo: the cabin functions an in-car assistant operates
(climate, windows, seats, navigation, media, lights, locks), each with a JSON Schema as an OpenAI
tool, and a state that every call changes and the demo prints.

    python demo/vehicle.py                 the tool list (JSON), for `cabinlm chat --tools FILE`
    Vehicle().call(name, arguments)        run one call: the result the model reads (JSON text)
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

ZONES = ["driver", "passenger", "rear_left", "rear_right"]
WINDOWS = ["front_left", "front_right", "rear_left", "rear_right"]


def tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


TOOLS = [
    tool("set_temperature", "Set the cabin temperature of one climate zone",
         {"zone": {"type": "string", "enum": ZONES}, "celsius": {"type": "number", "minimum": 16, "maximum": 28}},
         ["zone", "celsius"]),
    tool("set_fan", "Set the fan speed of the climate system (0 is off)",
         {"level": {"type": "integer", "minimum": 0, "maximum": 7}}, ["level"]),
    tool("set_air_conditioning", "Turn the air conditioning on or off",
         {"on": {"type": "boolean"}}, ["on"]),
    tool("open_window", "Open windows by a percentage (0 closes them)",
         {"windows": {"type": "array", "items": {"type": "string", "enum": WINDOWS}, "minItems": 1, "maxItems": 4},
          "percent": {"type": "integer", "minimum": 0, "maximum": 100}}, ["windows", "percent"]),
    tool("set_seat_heating", "Set a seat's heating level (0 is off)",
         {"seat": {"type": "string", "enum": ZONES}, "level": {"type": "integer", "minimum": 0, "maximum": 3}},
         ["seat", "level"]),
    tool("navigate_to", "Start route guidance to a destination",
         {"destination": {"type": "string", "minLength": 1, "maxLength": 80},
          "avoid": {"type": "array", "items": {"type": "string", "enum": ["tolls", "highways", "ferries"]},
                    "maxItems": 3}},
         ["destination"]),
    tool("find_charging_station", "Find charging stations near the car or the route",
         {"min_power_kw": {"type": "integer", "minimum": 11, "maximum": 350},
          "along_route": {"type": "boolean"}}, ["min_power_kw"]),
    tool("play_media", "Play music, a radio station or a podcast",
         {"source": {"type": "string", "enum": ["radio", "music", "podcast"]},
          "query": {"type": "string", "minLength": 1, "maxLength": 60}}, ["source", "query"]),
    tool("set_volume", "Set the media volume",
         {"level": {"type": "integer", "minimum": 0, "maximum": 30}}, ["level"]),
    tool("set_ambient_light", "Set the colour and brightness of the ambient lighting",
         {"color": {"type": "string", "enum": ["white", "blue", "red", "green", "amber", "purple"]},
          "brightness": {"type": "integer", "minimum": 0, "maximum": 100}}, ["color", "brightness"]),
    tool("lock_doors", "Lock or unlock all doors",
         {"locked": {"type": "boolean"}}, ["locked"]),
    tool("open_trunk", "Open the trunk", {}, []),
]  # fmt: skip


class Vehicle:
    """The car's state; call() applies one function call and returns the result the model reads."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {
            "temperature": {z: 21.0 for z in ZONES},
            "fan": 2,
            "air_conditioning": False,
            "windows": {w: 0 for w in WINDOWS},
            "seat_heating": {z: 0 for z in ZONES},
            "route": None,
            "media": None,
            "volume": 10,
            "ambient_light": {"color": "white", "brightness": 40},
            "locked": True,
            "trunk_open": False,
        }

    def call(self, name: str, arguments: dict) -> str:
        s = self.state
        if name == "set_temperature":
            s["temperature"][arguments["zone"]] = float(arguments["celsius"])
        elif name == "set_fan":
            s["fan"] = arguments["level"]
        elif name == "set_air_conditioning":
            s["air_conditioning"] = arguments["on"]
        elif name == "open_window":
            for w in arguments["windows"]:
                s["windows"][w] = arguments["percent"]
        elif name == "set_seat_heating":
            s["seat_heating"][arguments["seat"]] = arguments["level"]
        elif name == "navigate_to":
            s["route"] = {"destination": arguments["destination"], "avoid": arguments.get("avoid", []), "eta_min": 23}
        elif name == "find_charging_station":
            power = max(arguments["min_power_kw"], 50)
            return json.dumps({"stations": [{"name": "Ionity Rasthof Irschenberg", "power_kw": power, "km": 6.4}]})
        elif name == "play_media":
            s["media"] = {"source": arguments["source"], "query": arguments["query"]}
        elif name == "set_volume":
            s["volume"] = arguments["level"]
        elif name == "set_ambient_light":
            s["ambient_light"] = {"color": arguments["color"], "brightness": arguments["brightness"]}
        elif name == "lock_doors":
            s["locked"] = arguments["locked"]
        elif name == "open_trunk":
            s["trunk_open"] = True
        else:
            return json.dumps({"ok": False, "error": f"no function {name}"})
        return json.dumps({"ok": True})

    def changes(self, before: dict) -> dict:
        """What differs from an earlier copy of the state (copy.deepcopy(vehicle.state))."""
        return {k: v for k, v in self.state.items() if before.get(k) != v}

    def snapshot(self) -> dict:
        return copy.deepcopy(self.state)


if __name__ == "__main__":
    json.dump(TOOLS, sys.stdout, indent=1)
    sys.stdout.write("\n")
