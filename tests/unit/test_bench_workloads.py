"""The bench's workload generators: seeded, exact lengths, the reuse structure each one promises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.bench.config import BenchConfig, build_workload
from kvtool.bench.workloads.prefix_repetition import PrefixRepetitionOptions
from kvtool.bench.workloads.trace import TraceOptions
from kvtool.bench.oracle import common_prefix_length, ideal_hits
from kvtool.bench.workloads import WORKLOADS
from kvtool.bench.workloads.base import FIRST_TOKEN_ID, WorkloadShape, longest_prompts, prompts_known
from kvtool.bench.workloads.trace import TRACE_BLOCK_TOKENS, TraceReplay, read_trace, scaled_prompt, TraceRequest
from kvtool.errors import UserError

SHAPE = WorkloadShape(block_size=32, vocab_size=1024, requests=7, max_tokens=8, max_prompt_tokens=2039, seed=3)


def consumer_steps(steps):
    return [(i, s) for i, s in enumerate(steps) if s.target == "consumer"]


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_workload_is_seeded_valid_and_sized(name):
    workload = build_workload(name, BenchConfig())
    steps = workload.steps(SHAPE)
    assert steps == build_workload(name, BenchConfig()).steps(SHAPE)
    assert steps != workload.steps(WorkloadShape(**{**SHAPE.__dict__, "seed": 4}))
    assert len(consumer_steps(steps)) == SHAPE.requests
    for index, (step, longest) in enumerate(zip(steps, longest_prompts(steps), strict=True)):
        assert (step.prompt or step.history) and longest <= SHAPE.max_prompt_tokens
        assert all(FIRST_TOKEN_ID <= token < SHAPE.vocab_size for token in step.prompt)
        # A consumer reuses the producer's saves; a chat turn on the producer, the consumer's answer save.
        for earlier in (*step.depends_on, *(ref.step for ref in step.history)):
            assert earlier < index
        assert all(steps[earlier].target != step.target for earlier in step.depends_on)
        if step.target == "consumer":
            assert step.depends_on and step.max_tokens == SHAPE.max_tokens


def test_sub_block_publishes_prompts_shorter_than_a_block_and_extends_them():
    steps = build_workload("sub-block", BenchConfig()).steps(SHAPE)
    for _, step in consumer_steps(steps):
        (producer,) = step.depends_on
        base = steps[producer].prompt
        assert 0 < len(base) < SHAPE.block_size
        assert steps[producer].max_tokens == 1
        assert step.prompt[: len(base)] == base and len(step.prompt) > len(base)


def test_cross_block_prompts_end_mid_block_and_are_extended_or_repeated():
    steps = build_workload("cross-block", BenchConfig()).steps(SHAPE)
    labels = set()
    for _, step in consumer_steps(steps):
        base = steps[step.depends_on[0]].prompt
        assert len(base) > SHAPE.block_size and len(base) % SHAPE.block_size
        assert step.prompt[: len(base)] == base
        labels.add(step.label)
        if step.label == "repeated":
            assert step.prompt == base
    assert labels == {"extended", "repeated"}


def test_shared_prefix_members_share_a_system_prompt_ending_mid_block():
    steps = build_workload("shared-prefix", BenchConfig()).steps(SHAPE)
    for _, step in consumer_steps(steps):
        published = steps[step.depends_on[0]].prompt
        shared = common_prefix_length(published, step.prompt)
        assert shared < len(published) and shared < len(step.prompt)  # each has its own question


def test_multi_turn_extends_the_previous_turn_by_an_answer_and_a_message():
    steps = build_workload("multi-turn", BenchConfig()).steps(SHAPE)
    for _, step in consumer_steps(steps):
        previous = steps[step.depends_on[0]].prompt
        assert step.prompt[: len(previous)] == previous
        assert len(step.prompt) >= len(previous) + SHAPE.max_tokens + 4


def test_max_tokens_1_producer_prefills_what_the_consumer_continues():
    steps = build_workload("max-tokens-1", BenchConfig()).steps(SHAPE)
    for _, step in consumer_steps(steps):
        producer = steps[step.depends_on[0]]
        assert producer.max_tokens == 1 and producer.prompt == step.prompt


def test_prefix_repetition_has_the_datasets_shape():
    options = PrefixRepetitionOptions(prefix_len=40, suffix_len=9, num_prefixes=3)
    config = BenchConfig(workload_options={"prefix-repetition": options})
    steps = build_workload("prefix-repetition", config).steps(SHAPE)
    assert all(len(step.prompt) == 49 for step in steps)
    prefixes = {step.prompt[:40] for step in steps}
    assert len(prefixes) == 3
    assert sum(1 for s in steps if s.target == "producer") == 3


def test_unknown_workload_and_missing_trace_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="unknown workload 'nope'; pick from: sub-block"):
        build_workload("nope", BenchConfig())
    with pytest.raises(UserError, match="does not exist"):
        build_workload(f"trace:{tmp_path / 'missing.jsonl'}", BenchConfig())


# ---- trace replay ----------------------------------------------------------------------------


def write_trace(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def record(input_length: int, ids: list[int], output_length: int = 3) -> dict:
    return {"timestamp": 0, "input_length": input_length, "output_length": output_length, "hash_ids": ids}


def test_trace_scales_blocks_and_keeps_equal_ids_equal(tmp_path):
    trace = write_trace(
        tmp_path / "t.jsonl",
        [record(2 * 512 + 256, [1, 2, 3]), record(3 * 512, [1, 2, 4]), record(512 + 100, [9, 5])],
    )
    workload = TraceReplay(path=trace, block_tokens=16, count=3)
    steps = workload.steps(SHAPE)
    assert [s.target for s in steps] == ["consumer", "producer"] * 3
    first, second, third = (steps[i].prompt for i in (0, 2, 4))
    assert (len(first), len(second), len(third)) == (2 * 16 + 8, 48, 16 + 3)
    assert first[:32] == second[:32] and first[32] != second[32]
    assert common_prefix_length(third, first) == 0
    assert steps[2].depends_on == (1,) and steps[4].depends_on == (1, 3)
    assert steps[0].max_tokens == 3


def test_trace_start_and_count_pick_lines(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [record(512, [i]) for i in range(10)])
    assert [r.hash_ids for r in read_trace(trace, start=4, count=3)] == [(4,), (5,), (6,)]
    with pytest.raises(UserError, match="no requests from line 11"):
        read_trace(trace, start=10, count=3)


def test_trace_with_a_bad_line_is_a_one_line_error(tmp_path):
    trace = tmp_path / "bad.jsonl"
    trace.write_text(json.dumps(record(512, [1])) + "\nnot json\n")
    with pytest.raises(UserError, match=r"bad.jsonl line 2 is not a Mooncake trace record"):
        read_trace(trace, 0, 5)
    inconsistent = write_trace(tmp_path / "ids.jsonl", [record(1025, [1, 2])])
    with pytest.raises(UserError, match="needs 3 hash_ids, it has 2"):
        read_trace(inconsistent, 0, 5)


@pytest.mark.parametrize(
    "fields",
    [
        {"hash_ids": [[1]]},
        {"hash_ids": "a"},
        {"hash_ids": ["x"]},
        {"hash_ids": [None]},
        {"hash_ids": [1.5]},
        {"hash_ids": [True]},
        {"output_length": -5},
        {"input_length": 100.7},
        {"input_length": "512"},
    ],
)
def test_a_trace_record_of_the_wrong_types_is_one_sentence(tmp_path, fields):
    trace = tmp_path / "bad.jsonl"
    trace.write_text(json.dumps({**record(512, [1]), **fields}) + "\n")
    with pytest.raises(UserError, match=r"bad.jsonl line 1"):
        read_trace(trace, 0, 5)


def test_a_trace_that_is_not_text_is_one_sentence(tmp_path):
    trace = tmp_path / "binary.jsonl"
    trace.write_bytes(b"\xff\xfe\x00{}")
    with pytest.raises(UserError, match="not UTF-8"):
        read_trace(trace, 0, 5)


def test_trace_truncates_prompts_to_what_the_engine_takes(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [record(40 * 512, list(range(40)))])
    shape = WorkloadShape(**{**SHAPE.__dict__, "max_prompt_tokens": 100})
    steps = TraceReplay(path=trace, block_tokens=16).steps(shape)
    assert len(steps[0].prompt) == 100


@settings(max_examples=60, deadline=None)
@given(
    length=st.integers(1, 20 * TRACE_BLOCK_TOKENS),
    block_tokens=st.integers(2, 64),
)
def test_scaled_prompt_length_follows_the_block_scale(length, block_tokens):
    ids = tuple(range(-(-length // TRACE_BLOCK_TOKENS)))
    content = {i: tuple(range(block_tokens)) for i in ids}
    prompt = scaled_prompt(TraceRequest(length, 1, ids), block_tokens, content)
    full, remainder = divmod(length, TRACE_BLOCK_TOKENS)
    assert len(prompt) // block_tokens == full  # the partial block never fills a scaled block
    assert (len(prompt) % block_tokens > 0) == (remainder > 0)


def test_the_real_trace_file_replays():
    # The last 24 requests of the workplace's shared trace, kept in the repository (tests/data/README.md).
    trace = Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace_tail.jsonl"
    config = BenchConfig(workload_options={"trace": TraceOptions(trace_start=0, trace_requests=24)})
    steps = build_workload(f"trace:{trace}", config).steps(SHAPE)
    assert len(consumer_steps(steps)) == 24


shapes = st.builds(
    WorkloadShape,
    block_size=st.sampled_from([32, 64]),
    vocab_size=st.sampled_from([64, 1024]),
    requests=st.integers(1, 9),
    max_tokens=st.integers(1, 8),
    max_prompt_tokens=st.integers(400, 2000),
    seed=st.integers(0, 10_000),
)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, name=st.sampled_from(sorted(WORKLOADS)))
def test_workloads_hold_their_invariants_for_any_shape(shape, name):
    steps = build_workload(name, BenchConfig()).steps(shape)
    consumers = consumer_steps(steps)
    assert len(consumers) == shape.requests or name == "multi-turn"
    assert max(longest_prompts(steps)) <= shape.max_prompt_tokens
    if not prompts_known(steps):
        return  # chat: its ideals are fed at run time (tests/unit/test_bench_chat.py)
    ideal = ideal_hits(steps, shape.block_size, hash_unit=1)
    for index, step in consumers:
        assert 0 <= ideal[index] <= len(step.prompt) - 1


@settings(max_examples=40, deadline=None)
@given(shape=shapes, name=st.sampled_from(["sub-block", "cross-block", "multi-turn", "max-tokens-1"]))
def test_extension_workloads_ideal_is_the_whole_published_prompt(shape, name):
    # Each consumer prompt extends (or repeats) the prompt it depends on, so all of it is reusable.
    steps = build_workload(name, BenchConfig()).steps(shape)
    ideal = ideal_hits(steps, shape.block_size, hash_unit=1)
    for index, step in consumer_steps(steps):
        published = steps[step.depends_on[-1]].prompt
        assert ideal[index] >= min(len(published), len(step.prompt) - 1)
