"""The connector's scheduler side inside vLLM's real scheduler, against a real master: requests that
vLLM changes after their first lookup are keyed by what their blocks hold, and inputs the key schema
cannot encode are misses, never an exception on the engine's scheduler thread."""

from __future__ import annotations

import pytest
from vllm.v1.request import RequestStatus

from connector.core.hashing import RequestIdentity
from connector.core.keys import KeyKind
from connector.core.prefix import PromptKeys

from .vllm_scheduler import BLOCK_SIZE, SAMPLED_TOKEN, DrivenScheduler, driven_scheduler, new_request

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir():
    from kvtool.model import ensure_default_model

    return str(ensure_default_model())


@pytest.fixture
def driven(model_dir, master) -> DrivenScheduler:
    driven = driven_scheduler(model_dir, master.address, save_answers=True)
    yield driven
    driven.scheduler.shutdown()


def assert_keyed_by(driven: DrivenScheduler, saves, tokens: list[int]) -> None:
    """Every block and tail object the saves copy is named by the chain of ``tokens``, the tokens the
    blocks really hold, at its end."""
    keys = PromptKeys.build(tokens, BLOCK_SIZE, 1, driven.namespace, RequestIdentity().root_hash())
    transfers = [t for save in saves for t in save.transfers if t.kind in (KeyKind.BLOCK, KeyKind.TAIL)]
    assert transfers
    for transfer in transfers:
        assert transfer.token_end <= len(tokens)
        assert transfer.chain_hash == keys.chain_hash(transfer.token_end), (
            f"the object ending at {transfer.token_end} is keyed by other tokens than its block holds"
        )


def test_a_streaming_session_is_saved_under_the_tokens_its_blocks_hold(driven):
    """vLLM resumes a session (``_update_request_as_session``): the prompt becomes first prompt + kept
    answer + next chunk. Each chunk's prompt save and the final answer save name exactly that."""
    first, chunk = list(range(100, 150)), list(range(300, 330))
    scheduler = driven.scheduler
    scheduler.add_request(new_request("s1", first, max_tokens=3, resumable=True))
    session = scheduler.requests["s1"]
    driven.run_until(lambda: session.status == RequestStatus.WAITING_FOR_STREAMING_REQ)
    # Three sampled tokens; the last has no KV and is dropped when the session resumes.
    kept = [SAMPLED_TOKEN] * 2
    scheduler.add_request(new_request("s1", chunk, max_tokens=4, resumable=True))
    driven.run_until(lambda: session.prompt_token_ids == first + kept + chunk)
    driven.run_until(lambda: session.status == RequestStatus.WAITING_FOR_STREAMING_REQ)
    scheduler.add_request(new_request("s1", [], max_tokens=1, resumable=False))  # the end of the stream
    # The answer save goes to the worker with the next step (no worker here: vLLM holds the blocks).
    driven.run_until(lambda: any(s.answer for s in driven.saves))
    computed = first + kept + chunk + [SAMPLED_TOKEN] * 3
    prompt_saves = [s for s in driven.saves if not s.answer]
    answer_saves = [s for s in driven.saves if s.answer]
    assert len(prompt_saves) == 2, "each chunk's prompt is saved when complete"
    assert_keyed_by(driven, prompt_saves[:1], first)
    assert_keyed_by(driven, prompt_saves[1:], first + kept + chunk)
    assert prompt_saves[1].watermark_id != prompt_saves[0].watermark_id, "watermark records are immutable"
    assert_keyed_by(driven, answer_saves, computed)
    assert max(t.token_end for s in answer_saves for t in s.transfers) == len(computed)


def test_a_token_id_outside_the_key_schema_is_a_miss_not_a_crash(driven):
    """A prompt with an id the key schema cannot encode is neither looked up nor saved, and the
    engine's scheduler goes on serving it and the next request."""
    scheduler = driven.scheduler
    scheduler.add_request(new_request("bad", [5, -1, 6] * 20, max_tokens=2))
    scheduler.add_request(new_request("good", list(range(200, 260)), max_tokens=2))
    driven.run_until(lambda: {"bad", "good"} <= set(driven.finished))
    assert driven.finished["bad"]["kvtool"]["lookup"].startswith("not looked up: token id -1")
    assert not [s for s in driven.saves if s.req_id == "bad"]
    assert [s for s in driven.saves if s.req_id == "good"]
