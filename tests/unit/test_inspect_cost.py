"""`kvtool inspect prompt --cost`: an engine's cost model applied to the hit the store would give."""

from __future__ import annotations

import pytest

from kvtool.errors import UserError
from kvtool.inspect.cost import cost_verdict, parse_cost

MB = 1_000_000


def test_a_cheap_load_is_taken_whole():
    taken, why = cost_verdict(85, 32, 1 * MB, parse_cost("1,1000,2000"))  # CPU-like: 2 ms a token
    assert taken == 85 and why.startswith("taken whole")


def test_a_load_dearer_than_its_prefill_is_skipped():
    taken, why = cost_verdict(40, 32, 32 * MB, parse_cost("20,1000,10"))  # GPU-like prefill, a slow store
    assert taken == 0 and why.startswith("unprofitable: a load of")


def test_a_partial_block_that_does_not_pay_is_trimmed():
    taken, why = cost_verdict(70, 32, 1 * MB, parse_cost("1,1000,60"))
    assert taken == 64 and why.startswith("trimmed:")


@pytest.mark.parametrize("text", ["1,2", "a,b,c", "1,0,3", "-1,100,3"])
def test_a_bad_cost_is_one_clear_sentence(text):
    with pytest.raises(UserError, match="--cost"):
        parse_cost(text)
