"""Property tests of the numpy slot bookkeeping (contract/slots.py) against a plain-Python model of
the semantics, with K/V written where the plans say (backends/exported.write_slots).

The equivalence tests check the whole pipeline on a few streams; these check the bookkeeping on
thousands of random streams mixing chunk sizes and pinned spans, which the model tests cannot.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cabinlm.contract.errors import InputError, LayoutError
from cabinlm.contract.manifest import CacheLayout
from cabinlm.engines.ort_graph.backend import write_slots
from cabinlm.contract.slot_state import SlotState, StateError, check_state
from cabinlm.contract.slots import MASK_VALUE, SlotTable


class KVCache(SlotTable):
    """A slot table with host K/V buffers, committed as the exported-graph backend commits."""

    def __init__(self, layout: CacheLayout):
        super().__init__(layout)
        self.keys = np.zeros(layout.buffer_shape, np.float32)
        self.values = np.zeros(layout.buffer_shape, np.float32)

    def commit(self, plan, keys, values) -> None:
        write_slots(self.keys, keys, plan.slots)
        write_slots(self.values, values, plan.slots)
        self.advance(plan)


def layout(sink, pinned, window, chunk) -> CacheLayout:
    return CacheLayout(sink=sink, pinned=pinned, window=window, chunk=chunk, layers=2, kv_heads=1, head_dim=2)


def fake_kv(cache: KVCache, first: int, n: int) -> tuple[list, list]:
    """K/V whose every element is the stream index of its token, so slots can be read back."""
    lay = cache.layout
    vals = np.arange(first, first + n, dtype=np.float32)[None, :, None]
    k = [np.broadcast_to(vals, (lay.kv_heads, n, lay.head_dim)).copy() for _ in range(lay.layers)]
    return k, [x + 0.5 for x in k]


ops = st.lists(st.tuples(st.integers(1, 8), st.booleans()), min_size=1, max_size=60)


@settings(max_examples=300, deadline=None)
@given(
    sink=st.integers(0, 4),
    pinned=st.integers(0, 12),
    window=st.integers(8, 20),
    stream=ops,
)
def test_bookkeeping_matches_the_semantics(sink, pinned, window, stream):
    lay = layout(sink, pinned, window, chunk=8)
    cache = KVCache(lay)
    keys_addr, values_addr = cache.keys.ctypes.data, cache.values.ctypes.data
    model: list[tuple[int, bool]] = []  # (stream index, pinned) of cached tokens, in stream order
    pinned_used = 0
    for n, pin in stream:
        first = cache.seen
        want_pinned = max(0, n - max(0, sink - first)) if pin else 0
        if pin and pinned_used + want_pinned > pinned:
            with pytest.raises(InputError):
                cache.plan(n, pin=True)
            continue
        plan = cache.plan(n, pin=pin)
        # positions are ranks: cached tokens 0..L-1 in stream order, then the chunk L..L+n-1
        L = len(model)
        assert plan.position_ids.tolist() == list(range(L, L + n))
        valid = cache.slot_token >= 0
        by_rank = np.argsort(np.where(valid, cache.slot_token, 1 << 62))[:L]
        assert plan.cache_position_ids[by_rank].tolist() == list(range(L))
        assert cache.slot_token[by_rank].tolist() == [i for i, _ in model]
        # the mask lets each token see every cached token and the chunk up to itself
        assert ((plan.attention_mask[:, : lay.slots] == 0) == valid[None, :]).all()
        assert ((plan.attention_mask[:, lay.slots :] == 0) == np.tri(n, dtype=bool)).all()
        assert (plan.attention_mask[plan.attention_mask != 0] == MASK_VALUE).all()

        k, v = fake_kv(cache, first, n)
        cache.commit(plan, k, v)
        for t in range(first, first + n):
            is_pinned = t < sink or pin
            model.append((t, is_pinned))
            pinned_used += pin and t >= sink
        unpinned = [i for i, (_, p) in enumerate(model) if not p]
        drop = set(unpinned[: max(0, len(unpinned) - window)])
        model = [e for i, e in enumerate(model) if i not in drop]

        # the cache holds exactly the model's tokens, each slot holding its own K/V
        held = cache.slot_token[cache.slot_token >= 0]
        assert sorted(held.tolist()) == [i for i, _ in model]
        for slot in np.flatnonzero(cache.slot_token >= 0):
            tok = cache.slot_token[slot]
            assert (cache.keys[:, :, slot] == tok).all() and (cache.values[:, :, slot] == tok + 0.5).all()
        # sinks are the first tokens of the stream, in the sink slots
        assert cache.slot_token[: min(sink, cache.seen)].tolist() == list(range(min(sink, cache.seen)))
        assert cache.length == len(model)
    # buffers never moved
    assert cache.keys.ctypes.data == keys_addr and cache.values.ctypes.data == values_addr


def test_sink_and_pinned_slots_are_never_overwritten_by_the_window():
    lay = layout(sink=2, pinned=3, window=4, chunk=4)
    cache = KVCache(lay)
    for n, pin in [(2, False), (3, True)] + [(3, False)] * 30:
        k, v = fake_kv(cache, cache.seen, n)
        cache.commit(cache.plan(n, pin), k, v)
    assert cache.slot_token[:5].tolist() == [0, 1, 2, 3, 4]
    assert sorted(cache.slot_token[5:].tolist()) == list(range(cache.seen - 4, cache.seen))
    assert cache.evicted == cache.seen - 5 - 4


def test_a_chunk_crossing_the_ring_top_wraps():
    lay = layout(sink=0, pinned=0, window=6, chunk=4)
    cache = KVCache(lay)
    for n in (4, 4):  # the second chunk writes ring slots 4, 5, 0, 1
        k, v = fake_kv(cache, cache.seen, n)
        plan = cache.plan(n)
        cache.commit(plan, k, v)
    assert plan.slots.tolist() == [4, 5, 0, 1]
    assert cache.slot_token.tolist() == [6, 7, 2, 3, 4, 5]
    assert cache.evicted == 2


def test_pinning_more_than_the_pinned_region_is_refused_and_changes_nothing():
    cache = KVCache(layout(sink=1, pinned=2, window=4, chunk=4))
    before = (cache.slot_token.copy(), cache.seen)
    with pytest.raises(InputError, match="pinned region"):
        cache.plan(4, pin=True)  # 1 to the sink + 3 pinned > 2
    assert (cache.slot_token == before[0]).all() and cache.seen == before[1]


def test_layouts_are_validated():
    with pytest.raises(LayoutError, match="chunk"):
        layout(4, 0, window=8, chunk=16)
    with pytest.raises(LayoutError, match="sink"):
        layout(-1, 0, 8, 4)
    lay = layout(4, 4, 56, 8)
    assert lay.slots == 64 and lay.max_position == 72
    assert lay.bytes_per_token == 2 * 2 * 1 * 2 * 4  # K and V, layers, kv heads, head_dim, fp32
    assert KVCache(lay).keys.nbytes * 2 == lay.cache_bytes


@settings(max_examples=150, deadline=None)
@given(sink=st.integers(0, 3), pinned=st.integers(0, 6), window=st.integers(8, 12), stream=ops,
       image=st.integers(0, 4), frame_every=st.integers(1, 5))
def test_a_state_restored_into_a_fresh_table_plans_exactly_as_the_original(sink, pinned, window, stream, image, frame_every):
    """Round trip of state()/restore(), with camera frames replacing each other: the restored table
    plans the same slots, positions and mask for every next chunk size."""
    lay = CacheLayout(sink=sink, pinned=pinned, image=image, window=window, chunk=8, layers=1, kv_heads=1, head_dim=2)
    table = SlotTable(lay)
    for i, (n, pin) in enumerate(stream):
        if image and i % frame_every == 0:
            table.begin_frame()
            table.advance(table.plan(min(image, 8), pin="image")) if min(image, 8) <= image else None
        if pin and n - max(0, sink - table.sink_fill) > table.pinned_free:
            continue
        table.advance(table.plan(n, pin=pin))
    fresh = SlotTable(lay)
    fresh.restore(table.state())
    assert fresh.state().counters() == table.state().counters()
    for n in (1, 3, 8):
        a, b = table.plan(n), fresh.plan(n)
        assert (a.slots == b.slots).all() and (a.position_ids == b.position_ids).all()
        assert (a.cache_position_ids == b.cache_position_ids).all() and (a.attention_mask == b.attention_mask).all()


@settings(max_examples=200, deadline=None)
@given(stream=ops, field=st.sampled_from(SlotState.COUNTERS + ("slot",)), delta=st.integers(-3, 3).filter(bool))
def test_a_tampered_state_is_refused_before_it_is_used(stream, field, delta):
    """A session file's slot state is untrusted: a counter or a slot moved away from what the
    table holds is refused by check_state (or still describes a consistent table)."""
    lay = layout(sink=2, pinned=6, window=10, chunk=8)
    table = SlotTable(lay)
    for n, pin in stream:
        if not (pin and n - max(0, lay.sink - table.sink_fill) > table.pinned_free):
            table.advance(table.plan(n, pin=pin))
    state = table.state()
    if field == "slot":
        st_ = state.slot_token.copy()
        st_[len(st_) // 2] += delta
        bad = SlotState(st_, **state.counters())
    else:
        bad = SlotState(state.slot_token, **{**state.counters(), field: state.counters()[field] + delta})
    fresh = SlotTable(lay)
    try:
        check_state(bad, lay)
    except StateError:
        with pytest.raises(StateError):
            fresh.restore(bad)
        assert fresh.seen == 0 and (fresh.slot_token == -1).all()  # refused: nothing changed
        return
    # accepted: then it is a table the bookkeeping can go on from without breaking its invariants
    fresh.restore(bad)
    for _ in range(lay.window + 3):
        fresh.advance(fresh.plan(1))
    check_state(fresh.state(), lay)


@settings(max_examples=200, deadline=None)
@given(sink=st.integers(0, 3), pinned=st.integers(0, 6), window=st.integers(8, 12), stream=ops,
       image=st.integers(0, 4), frame_every=st.integers(1, 5))
def test_a_plan_carries_the_table_as_it_stood_and_keeps_it_after_the_table_moves(sink, pinned, window, stream, image,
                                                                                 frame_every):  # fmt: skip
    """What a backend reads of a step (StepPlan: L, F, E, the fills, the frames, the slot table) is
    the table's when the plan was made, for decode steps and chunks alike, and stays so after the
    table advances (a backend never reads the table itself)."""
    lay = CacheLayout(sink=sink, pinned=pinned, image=image, window=window, chunk=8, layers=1, kv_heads=1, head_dim=2)
    table = SlotTable(lay)
    facts = ("evicted", "sink_fill", "pinned_fill", "image_fill", "frames")
    for i, (n, pin) in enumerate(stream):
        if image and i % frame_every == 0:
            table.begin_frame()
            table.advance(table.plan(min(image, 8), pin="image"))
        if pin and n - max(0, sink - table.sink_fill) > table.pinned_free:
            continue
        before = ({k: getattr(table, k) for k in facts}, table.length, table.extent, table.slot_token.copy())
        for size in (1, n):
            plan = table.plan(size, pin=pin)
            assert {k: getattr(plan, k) for k in facts} == before[0]
            assert (plan.cached, plan.extent) == before[1:3] and (plan.slot_token == before[3]).all()
            assert plan.slot_token is not table.slot_token
        table.advance(plan)
        assert {k: getattr(plan, k) for k in facts} == before[0] and (plan.slot_token == before[3]).all()


@settings(max_examples=200, deadline=None)
@given(sink=st.integers(1, 3), pinned=st.integers(0, 6), window=st.integers(8, 12), stream=ops,
       image=st.integers(0, 3), n=st.integers(2, 8))
def test_a_chunk_planned_as_steps_carries_each_steps_facts(sink, pinned, window, stream, image, n):
    """StepPlan(steps=True), what a backend runs a verified draft from: for each row, its rank, E,
    the sink / pinned slots and their ranks, and the token its slot held, equal what the one-token
    plan made after the rows before it says (the table advanced one token at a time: the plain
    reference), through the window's turnover, camera frames, and pinned spans younger than window
    tokens (whose ranks fall as older window tokens are evicted)."""
    lay = CacheLayout(sink=sink, pinned=pinned, image=image, window=window, chunk=8, layers=1, kv_heads=1, head_dim=2)
    table = SlotTable(lay)
    for i, (size, pin) in enumerate(stream):
        if image and i % 3 == 0:
            table.begin_frame()
            table.advance(table.plan(image, pin="image"))
        if pin and size - max(0, sink - table.sink_fill) > table.pinned_free:
            continue
        table.advance(table.plan(size, pin=pin))
        if table.sink_fill < sink:
            with pytest.raises(ValueError, match="after a full sink"):
                table.plan(n, steps=True)
            continue
        plan = table.plan(n, steps=True)
        steps = SlotTable(lay)
        steps.restore(table.state())
        for row in range(n):
            one = steps.plan(1)
            assert plan.slots[row] == one.slots[0]
            assert plan.position_ids[row] == one.position_ids[0]
            assert plan.row_evicted[row] == one.evicted
            assert plan.overwritten[row] == one.slot_token[one.slots[0]]
            np.testing.assert_array_equal(plan.pinned_slots, one.pinned_slots)
            np.testing.assert_array_equal(plan.row_pinned_ranks[row], one.cache_position_ids[one.pinned_slots])
            steps.advance(one)
        assert plan.row_evicted[-1] + (plan.overwritten[-1] >= 0) == plan.evicted + plan.evicts
