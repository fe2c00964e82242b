"""The server's figures, read at the moment they are asked for: one snapshot, two formats.

    GET /v1/metrics.json   snapshot(): what the page's live panel polls (JSON)
    GET /metrics           the same snapshot in Prometheus' text exposition format (ServeCollector),
                           with prometheus_client's standard process_* figures beside it

Nothing is counted twice: every figure is read from the service (its seats, their caches, the
process) when a client asks, so /metrics, /v1/metrics.json and /v1/seats agree whenever the seats
are idle. Read from the event loop's thread, as every other reader of the seats (SeatManager).

    cabinlm_info{model, backend}                  1
    cabinlm_seats / _seats_taken / _seats_busy    seats configured, named, answering now
    cabinlm_requests_answered_total               chat completions answered since the start
    cabinlm_cache_slots                           cache slots a seat has (sink + pinned + image + window)
    cabinlm_seat_cache_tokens{seat}               tokens the seat's cache holds now
    cabinlm_seat_evicted_tokens{seat}             window tokens its conversation evicted so far
    cabinlm_seat_turns{seat}                      turns its conversation holds
    cabinlm_seat_busy{seat}                       1 while it answers
    cabinlm_seat_decode_tokens_per_second{seat}   its last turn's decode speed (absent before one)
    cabinlm_process_resident_memory_bytes         RSS, as runtime.memory reads it
    process_resident_memory_bytes, ...            prometheus_client's ProcessCollector (/proc)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cabinlm.runtime.memory import rss_bytes

if TYPE_CHECKING:
    from cabinlm.serve.service import ChatService


def snapshot(service: ChatService) -> dict[str, Any]:
    """Every figure the live panel and /metrics show, read now."""
    seats = list(service.seats.seats.values())
    return {
        "object": "cabinlm.metrics",
        "time": round(time.time(), 3),
        "model": service.model_id,
        "backend": service.device,
        "rss_bytes": rss_bytes(),
        "requests_answered": service.answered,
        "cache_slots": service.manifest.cache.slots,
        "seats": {"total": service.seats.total, "taken": len(seats), "busy": sum(s.busy for s in seats)},
        "data": [s.describe() for s in seats],
    }


class ServeCollector:
    """prometheus_client's custom-collector protocol over snapshot(): collect() runs at every scrape."""

    def __init__(self, service: ChatService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        s = snapshot(self.service)
        info = GaugeMetricFamily("cabinlm_info", "The model served and the backend it runs on", labels=["model", "backend"])
        info.add_metric([s["model"], s["backend"]], 1)
        yield info
        yield GaugeMetricFamily("cabinlm_seats", "Seats the server holds (--seats)", value=s["seats"]["total"])
        yield GaugeMetricFamily("cabinlm_seats_taken", "Seats a conversation has named", value=s["seats"]["taken"])
        yield GaugeMetricFamily("cabinlm_seats_busy", "Seats answering a request now", value=s["seats"]["busy"])
        yield CounterMetricFamily("cabinlm_requests_answered", "Chat completions answered since the server started",
                                  value=s["requests_answered"])  # fmt: skip
        yield GaugeMetricFamily("cabinlm_cache_slots", "Cache slots of one seat: sink + pinned + image + window",
                                value=s["cache_slots"])  # fmt: skip
        yield GaugeMetricFamily("cabinlm_process_resident_memory_bytes", "Resident set size of the server process",
                                value=s["rss_bytes"])  # fmt: skip
        per_seat = {
            "cache_tokens": GaugeMetricFamily("cabinlm_seat_cache_tokens", "Tokens the seat's cache holds",
                                              labels=["seat"]),
            "evicted_tokens": GaugeMetricFamily("cabinlm_seat_evicted_tokens",
                                                "Window tokens the seat's conversation evicted so far", labels=["seat"]),
            "turns": GaugeMetricFamily("cabinlm_seat_turns", "Turns the seat's conversation holds", labels=["seat"]),
        }  # fmt: skip
        busy = GaugeMetricFamily("cabinlm_seat_busy", "1 while the seat answers a request", labels=["seat"])
        speed = GaugeMetricFamily("cabinlm_seat_decode_tokens_per_second", "Decode speed of the seat's last turn",
                                  labels=["seat"])  # fmt: skip
        for seat in s["data"]:
            for key, family in per_seat.items():
                family.add_metric([seat["name"]], seat[key])
            busy.add_metric([seat["name"]], int(seat["busy"]))
            last = seat["last"]
            if last is not None and last.get("decode_tok_s") is not None:
                speed.add_metric([seat["name"]], last["decode_tok_s"])
        yield from per_seat.values()
        yield busy
        yield speed


def registry(service: ChatService) -> CollectorRegistry:
    """What GET /metrics exposes (prometheus_client.generate_latest): the service's figures and the
    process's. A registry of its own, not the library's global one: two servers in one process (tests)
    would otherwise clash, and nothing else in the process registers metrics."""
    r = CollectorRegistry(auto_describe=False)
    r.register(ServeCollector(service))
    ProcessCollector(registry=r)
    return r
