"""The chat workload: turns that continue the model's real answers, resolved as the run goes, and its
oracle: the ideal against everything computed before (no pair: a fake engine answers). A run against
a fake pair and its report: ``test_bench_chat_run``."""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.bench.command import plan_workloads
from kvtool.bench.config import BenchConfig, build_workload
from kvtool.bench.oracle import (
    PlannedIdeals,
    ReuseOracle,
    computed_tokens,
    ideal_hit,
    ideal_hits,
    on_reuse_grid,
    run_ideals,
)
from kvtool.bench.workloads import WORKLOADS, Ref, Step, Transcript, WorkloadShape
from kvtool.bench.workloads.base import longest_prompts, prompts_known
from kvtool.bench.workloads.chat import Chat

SHAPE = WorkloadShape(block_size=16, vocab_size=512, requests=7, max_tokens=6, max_prompt_tokens=1000, seed=5)
tokens = st.lists(st.integers(0, 3), max_size=40)


def fake_answer(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    """A deterministic "model": the answer is a function of the prompt, sometimes shorter (an EOS)."""
    length = 1 + sum(prompt) % max_tokens
    return tuple(3 + (sum(prompt) * 7 + i) % 97 for i in range(length))


def resolve_all(steps: list[Step]) -> list[tuple[int, ...]]:
    """Every step's prompt as a run sends it, with ``fake_answer`` as each step's answer."""
    transcript, prompts = Transcript(), []
    for index, step in enumerate(steps):
        prompts.append(transcript.resolve(index, step))
        transcript.answered(index, fake_answer(prompts[-1], step.max_tokens))
    return prompts


# ---- the workload ---------------------------------------------------------------------------


def test_chat_is_registered_and_alternates_prefill_and_answer():
    assert "chat" in WORKLOADS
    steps = build_workload("chat", BenchConfig()).steps(SHAPE)
    assert sum(1 for s in steps if s.target == "consumer") == SHAPE.requests
    assert not prompts_known(steps)
    for index, step in enumerate(steps):
        if step.target == "producer":
            assert step.max_tokens == 1 and step.prompt  # the turn's new tokens: P_0 or a user message
            assert steps[index + 1].history == (Ref(index, "prompt"),)  # the consumer answers that prompt
        else:
            assert step.prompt == () and step.depends_on == (index - 1,) and step.max_tokens == SHAPE.max_tokens
        if step.history and step.target == "producer":  # a later turn: the previous turn and its answer
            (answer,) = step.depends_on
            assert step.history == (Ref(answer, "prompt"), Ref(answer, "answer"))


def test_a_conversation_starts_mid_block_and_has_at_most_its_turns():
    steps = Chat(turns_per_chat=2).steps(SHAPE)
    openings = [s for s in steps if s.target == "producer" and not s.history]
    assert all(len(s.prompt) % SHAPE.block_size for s in openings)
    assert len(openings) == -(-SHAPE.requests // 2)


def test_turns_continue_the_real_answers():
    steps = Chat().steps(SHAPE)
    prompts = resolve_all(steps)
    for index, step in enumerate(steps):
        if step.target == "consumer":
            assert prompts[index] == prompts[index - 1]  # the prompt the producer prefilled
        elif step.history:
            previous = step.depends_on[0]
            answer = fake_answer(prompts[previous], steps[previous].max_tokens)
            assert prompts[index] == prompts[previous] + answer + step.prompt


@settings(max_examples=40, deadline=None)
@given(
    max_prompt=st.integers(40, 200),
    max_tokens=st.integers(1, 16),
    requests=st.integers(1, 9),
    seed=st.integers(0, 1000),
)
def test_no_resolved_prompt_exceeds_the_engine_limit(max_prompt, max_tokens, requests, seed):
    shape = WorkloadShape(16, 64, requests, max_tokens, max_prompt, seed)
    steps = Chat().steps(shape)
    longest = longest_prompts(steps)
    assert max(longest) <= max_prompt
    for prompt, bound in zip(resolve_all(steps), longest, strict=True):
        assert 0 < len(prompt) <= bound


def test_the_transcript_refuses_an_answer_it_does_not_have():
    steps = [Step("consumer", (5, 6), 2), Step("producer", (7,), 1, (0,), history=(Ref(0, "answer"),))]
    transcript = Transcript()
    transcript.resolve(0, steps[0])
    with pytest.raises(ValueError, match="step 1 continues step 0's answer"):
        transcript.resolve(1, steps[1])
    transcript.answered(0, (9, 9))
    assert transcript.resolve(1, steps[1]) == (9, 9, 7)


def test_the_plan_leaves_chat_ideals_to_the_run_and_bounds_its_prompts():
    config = BenchConfig(workloads=("chat", "sub-block"), requests=3, max_tokens=4, quiet_s=0)
    chat, sub_block = plan_workloads(config, block_size=16, hash_unit=1, vocab_size=64, max_model_len=120)
    assert chat.ideal is None and sub_block.ideal is not None
    assert max(longest_prompts(chat.steps)) <= 120 - 4 - 1
    with pytest.raises(ValueError, match="fed at run time"):
        ideal_hits(chat.steps, 16, 1)


# ---- the oracle -----------------------------------------------------------------------------


def test_computed_tokens_leave_out_the_last_generated_token():
    assert computed_tokens((1, 2), (3, 4, 5)) == (1, 2, 3, 4)
    assert computed_tokens((1, 2), (3,)) == (1, 2)  # max_tokens=1: only the prompt
    assert computed_tokens((1, 2), ()) == (1, 2)


def test_chat_ideals_are_the_previous_turn_and_answer_on_the_producer_and_all_on_the_consumer():
    p0, a0, m1 = tuple(range(10, 30)), (50, 51, 52, 53), (60, 61, 62)
    oracle = ReuseOracle(block_size=8, hash_unit=1)
    assert oracle.of(0, p0) == 0
    oracle.ran(p0, (40,))  # the producer prefills P_0 (max_tokens=1)
    assert oracle.of(1, p0) == len(p0) - 1
    oracle.ran(p0, a0)  # the consumer answers A_0
    p1 = p0 + a0 + m1
    assert oracle.of(2, p1) == len(p0) + len(a0) - 1
    coarse = ReuseOracle(block_size=8, hash_unit=8)
    coarse.ran(p0, a0)
    assert coarse.of(0, p1) == on_reuse_grid(len(p0) + len(a0) - 1, 8, 8) == 16


@settings(max_examples=200)
@given(
    requests=st.lists(st.tuples(tokens, tokens), max_size=5),
    prompt=tokens,
    block=st.sampled_from([4, 8]),
    unit=st.integers(1, 8),
)
def test_the_oracle_is_the_ideal_over_everything_computed_before(requests, prompt, block, unit):
    unit = min(unit, block)
    oracle = ReuseOracle(block, unit)
    for earlier_prompt, answer in requests:
        oracle.ran(earlier_prompt, answer)
    computed = [(*p, *a[:-1]) for p, a in requests]
    ideal = oracle.of(len(requests), prompt)
    assert ideal == ideal_hit(prompt, computed, block, unit)

    # By enumeration: the longest boundary on the grid that something computed shares, capped.
    def reusable(boundary: int) -> bool:
        on_grid = boundary % unit == 0 or boundary % block == 0
        return on_grid and any(tuple(prompt[:boundary]) == c[:boundary] for c in computed)

    best = max((b for b in range(len(prompt) + 1) if reusable(b)), default=0)
    assert ideal == min(best, max(0, len(prompt) - 1))
    oracle.ran((), ())
    assert oracle.of(0, prompt) == ideal  # more to reuse never lowers an ideal


def test_run_ideals_are_planned_or_fed():
    planned = run_ideals({1: 7}, 8, 1)
    assert isinstance(planned, PlannedIdeals)
    assert (planned.of(0, (1, 2)), planned.of(1, (1, 2))) == (None, 7)
    assert isinstance(run_ideals(None, 8, 1), ReuseOracle)
