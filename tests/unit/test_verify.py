from kvtool.verify import compare_answers


def response(tokens, tops):
    return {"choices": [{"logprobs": {"tokens": tokens, "top_logprobs": tops}}]}


REF = response(["a", "b"], [{"a": -0.1, "b": -2.0, "c": -3.0}, {"b": -0.2, "a": -1.5, "d": -4.0}])


def test_identical_answers_match():
    assert compare_answers(REF, REF).matches


def test_small_differences_are_tolerated():
    close = response(["a", "b"], [{"a": -0.1001, "b": -2.0, "c": -3.0}, {"b": -0.2, "a": -1.5, "d": -4.0002}])
    result = compare_answers(close, REF)
    assert result.matches and 0 < result.max_logprob_diff < 1e-3


def test_a_logprob_off_by_more_than_the_tolerance_fails():
    off = response(["a", "b"], [{"a": -0.1, "b": -2.5, "c": -3.0}, {"b": -0.2, "a": -1.5, "d": -4.0}])
    assert not compare_answers(off, REF).matches


def test_different_tokens_fail():
    assert not compare_answers(response(["a", "a"], REF["choices"][0]["logprobs"]["top_logprobs"]), REF).matches


def test_a_near_tie_at_the_last_place_may_swap():
    ref = response(["a"], [{"a": -0.1, "b": -3.0, "c": -3.0001}])
    swapped = response(["a"], [{"a": -0.1, "b": -3.0, "x": -3.0002}])
    assert compare_answers(swapped, ref).matches


def test_a_far_token_entering_the_top_k_fails():
    ref = response(["a"], [{"a": -0.1, "b": -3.0, "c": -3.5}])
    other = response(["a"], [{"a": -0.1, "b": -3.0, "x": -2.0}])
    assert not compare_answers(other, ref).matches


def test_missing_logprobs_fail():
    assert not compare_answers(response(["a"], []), response(["a"], [])).matches
