"""Decode variants with a slot limit (``layout["slot_limit"]``, docs/api.md "Slot limit"): the rule that allows one,
the validator's SLOT-LIMIT, and the runtime's side: free slots taken lowest first and rounds submitted to the smallest
variant whose capacity and limit fit. ``tests/test_recipes.py`` checks the limited graphs against transformers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ignition.catalog.enums import Operation
from ignition.catalog.model import admits_slots, decode_slot_limit
from ignition.catalog.rules import RULES
from ignition.runtime.runner import FreeSlots, Runner, smallest_fitting
from ignition.validate.contract_rules import _check_slot_limits


@pytest.mark.parametrize("capacity,capacities,slots,limit", [
    (8, (1, 8, 32), 32, 8),  # below the slots and the widest decode variant
    (32, (1, 8, 32), 32, None),  # the widest: serves every slot
    (8, (1, 8), 32, None),  # the widest, though the cache has more slots
    (8, (1, 8), 8, None),  # every slot already
    (1, (1, 8, 32), 32, None),  # one lane copies its own slot's window
    (2, (1, 2, 4), 4, 2),
])
def test_which_decode_variants_may_declare_a_slot_limit(capacity, capacities, slots, limit):
    assert decode_slot_limit(capacity, capacities, slots) == limit


def _variant(name: str, operation: Operation, capacity: int, limit: int | None) -> dict:
    layout = {} if limit is None else {"slot_limit": limit}
    return {"name": name, "operation": int(operation), "capacity": capacity, "contract": {"layout": layout}}


@pytest.mark.parametrize("variants,wrong", [
    ([_variant("decode.c1", Operation.DECODE, 1, None), _variant("decode.c8", Operation.DECODE, 8, 8),
      _variant("decode.c32", Operation.DECODE, 32, None)], []),
    ([_variant("decode.c8", Operation.DECODE, 8, 4), _variant("decode.c32", Operation.DECODE, 32, None)],
     ["decode.c8"]),  # not its capacity
    ([_variant("decode.c8", Operation.DECODE, 8, 8), _variant("decode.c32", Operation.DECODE, 32, 32)],
     ["decode.c32"]),  # the widest: some slots could never decode
    ([_variant("decode.c8", Operation.DECODE, 8, None), _variant("packed.t16.c8", Operation.PACKED_PREFILL, 8, 8),
      _variant("decode.c32", Operation.DECODE, 32, None)], ["packed.t16.c8"]),  # decode only
])
def test_the_validator_refuses_a_slot_limit_the_rule_does_not_allow(variants, wrong):
    decode = sorted(v["capacity"] for v in variants if v["operation"] == Operation.DECODE)
    found = _check_slot_limits({"model": {"num_slots": 32}}, variants, decode)
    assert [v.where.split(":")[0].removeprefix("variant ") for v in found] == wrong
    assert all(v.rule == "SLOT-LIMIT" and "expected" in v.message for v in found) and "SLOT-LIMIT" in RULES


def test_free_slots_are_taken_lowest_first():
    free = FreeSlots(4)
    taken = [free.take() for _ in range(3)]
    free.give(1)
    free.give(0)
    assert taken == [0, 1, 2] and list(free) == [0, 1, 3] and 3 in free and 2 not in free
    assert [free.take(), free.take()] == [0, 1] and len(free) == 1


def _lanes(*slots: int) -> list:
    return [SimpleNamespace(state=SimpleNamespace(slot=slot)) for slot in slots]


def test_a_round_runs_in_the_smallest_variant_its_slots_fit():
    variants = [SimpleNamespace(name=f"decode.c{c}", capacity=c, layout={} if limit is None else {"slot_limit": limit})
                for c, limit in ((1, None), (8, 8), (32, None))]
    assert smallest_fitting(variants, _lanes(5)).name == "decode.c1"  # one lane: no limit on c1
    assert smallest_fitting(variants, _lanes(0, 7)).name == "decode.c8"
    assert smallest_fitting(variants, _lanes(0, 8)).name == "decode.c32"  # slot 8 is past c8's limit
    assert admits_slots({"slot_limit": 8}, [7]) and not admits_slots({"slot_limit": 8}, [8]) and admits_slots({}, [31])


def test_the_runner_refuses_lanes_past_a_variant_slot_limit():
    runner = Runner(SimpleNamespace(variants={}))
    variant = SimpleNamespace(name="decode.c8", layout={"slot_limit": 8})
    with pytest.raises(ValueError, match=r"decode.c8 serves slots below 8 only, and the lanes hold slots \[3, 9\]"):
        runner.submit(variant, _lanes(3, 9))
