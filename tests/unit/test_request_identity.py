"""Request side of the identity (issue 8): prompt embeddings, LoRA paths and multimodal positions move
the chain root; a plain text request keeps the root it always had."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.core.hashing import RequestIdentity
from connector.core.identity import UnhashableRequest, embeddings_digest, request_identity


# -- request side -----------------------------------------------------------------------------------


def request(tokens=(1, 2, 3), embeds=None, mask=None, salt=None, lora=None, features=()):
    return SimpleNamespace(
        request_id="r",
        prompt_token_ids=list(tokens),
        prompt_embeds=embeds,
        prompt_is_token_ids=mask,
        cache_salt=salt,
        lora_request=lora,
        mm_features=list(features),
    )


def root(req):
    return request_identity(req).root_hash()


def test_text_requests_keep_todays_roots():
    # The roots every stored key was made with: a request without embeddings (or LoRA) keeps them.
    assert root(request()) == RequestIdentity().root_hash()
    assert root(request(salt="alice")) == RequestIdentity(cache_salt="alice").root_hash()
    assert RequestIdentity().root_hash().hex() == KNOWN_ROOT
    assert RequestIdentity(cache_salt="alice").root_hash().hex() == KNOWN_SALTED_ROOT


KNOWN_ROOT = "80e60d2914f13000383418ab4082a98a"  # computed with the code before the identity fields existed
KNOWN_SALTED_ROOT = "339294933035e5750d2945a636832fa2"  # computed with the code before the identity fields existed


def test_embeddings_never_share_a_root_with_text_of_the_same_ids():
    embeds = torch.randn(3, 8)
    assert root(request(embeds=embeds)) != root(request())
    assert root(request(embeds=embeds)) == root(request(embeds=embeds.clone()))
    assert root(request(embeds=embeds, salt="a")) != root(request(salt="a"))


def test_different_embeddings_differ():
    embeds = torch.randn(3, 8)
    changed = embeds.clone()
    changed[1, 4] += 1.0
    assert root(request(embeds=embeds)) != root(request(embeds=changed))


def test_dtype_shape_and_mask_are_part_of_the_digest():
    raw = torch.arange(24, dtype=torch.int16)
    as_int16 = raw.reshape(3, 8)
    as_bf16 = raw.view(torch.bfloat16).reshape(3, 8)  # the same bytes, another dtype
    reshaped = raw.reshape(4, 6)  # the same bytes, another shape
    digests = {embeddings_digest(t) for t in (as_int16, as_bf16, reshaped)}
    assert len(digests) == 3
    mixed = {
        embeddings_digest(as_bf16, None),
        embeddings_digest(as_bf16, [True, False, False]),
        embeddings_digest(as_bf16, [False, True, False]),
    }
    assert len(mixed) == 3


def test_digest_reads_any_layout_on_the_cpu():
    embeds = torch.randn(8, 4)
    assert embeddings_digest(embeds.t().contiguous().t()) == embeddings_digest(embeds)  # strides do not matter
    assert embeddings_digest(embeds.to_sparse()) == embeddings_digest(embeds)
    assert embeddings_digest(embeds.requires_grad_()) == embeddings_digest(embeds.detach())


@settings(max_examples=50, deadline=None)
@given(
    a=st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=24),
    b=st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=24),
)
def test_digests_are_equal_exactly_when_the_bytes_are(a, b):
    ta, tb = torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)
    same = ta.shape == tb.shape and ta.numpy().tobytes() == tb.numpy().tobytes()
    assert (embeddings_digest(ta) == embeddings_digest(tb)) == same


def test_unreadable_embeddings_make_the_request_unhashable():
    for bad in ([[0.1, 0.2]], "embeds", torch.randn(2, 2, device="meta")):
        with pytest.raises(UnhashableRequest):
            request_identity(request(embeds=bad))


def test_lora_path_and_multimodal_positions_separate_requests():
    lora_a = SimpleNamespace(lora_name="ad", lora_int_id=1, lora_path="/adapters/a")
    lora_b = SimpleNamespace(lora_name="ad", lora_int_id=1, lora_path="/adapters/b")
    assert root(request(lora=lora_a)) != root(request(lora=lora_b))
    assert root(request(lora=lora_a)) == root(request(lora=copy.copy(lora_a)))

    def feature(offset):
        return SimpleNamespace(identifier="img-1", mm_position=SimpleNamespace(offset=offset, length=4))

    assert root(request(features=[feature(0)])) != root(request(features=[feature(2)]))
    assert root(request(features=[feature(0)])) == root(request(features=[feature(0)]))
    with pytest.raises(UnhashableRequest):
        request_identity(request(features=[SimpleNamespace(identifier=None, mm_position=None)]))


def test_real_vllm_requests_carry_embeddings_where_we_read_them():
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    embeds = torch.randn(4, 8)
    params = SamplingParams(max_tokens=1)
    text = Request("t", [5, 6, 7, 8], params, None)
    only_embeds = Request("e", None, params, None, prompt_embeds=embeds)
    mixed = Request(
        "m", [5, 0, 0, 8], params, None, prompt_embeds=embeds, prompt_is_token_ids=[True, False, False, True]
    )
    same_ids = Request("s", [5, 0, 0, 8], params, None)  # text with the mixed prompt's placeholder ids
    assert len({root(r) for r in (text, only_embeds, mixed)}) == 3
    assert root(mixed) != root(same_ids)
    assert root(text) == root(same_ids) == RequestIdentity().root_hash()  # text: today's root, tokens apart


def test_multimodal_requests_are_not_keyed_where_vllm_names_their_inputs_by_a_counter():
    """With vLLM's prefix caching and its multimodal processor cache both off, an input is named
    ``renderer0-mm-<n>-image-0`` (a per-process request counter): another image after a restart, or in
    another engine, gets the same name. Such requests are neither looked up nor saved; text ones are."""
    from connector.connector import _mm_named_by_content
    from connector.scheduler.tracking import KeySpace, request_keys

    def engine_config(cache_gb, prefix_caching, multimodal=True):
        mm = SimpleNamespace(mm_processor_cache_gb=cache_gb) if multimodal else None
        return SimpleNamespace(
            model_config=SimpleNamespace(multimodal_config=mm),
            cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
        )

    assert _mm_named_by_content(engine_config(0, False)) is False
    assert _mm_named_by_content(engine_config(4, False)) is True
    assert _mm_named_by_content(engine_config(0, True)) is True
    assert _mm_named_by_content(engine_config(0, False, multimodal=False)) is True
    assert _mm_named_by_content(SimpleNamespace()) is False  # unreadable: only multimodal requests unkeyed

    space = KeySpace(32, 1, "ns", (), 0, mm_named_by_content=False)
    image = SimpleNamespace(identifier="renderer0-mm-1-image-0", mm_position=SimpleNamespace(offset=0, length=4))
    keys, why = request_keys(request(tokens=range(40), features=[image]), space)
    assert keys.tokens == () and "multimodal" in why
    keys, why = request_keys(request(tokens=range(40)), space)
    assert len(keys.tokens) == 40 and why is None
    keys, why = request_keys(request(tokens=range(40), features=[image]), KeySpace(32, 1, "ns", (), 0))
    assert len(keys.tokens) == 40 and why is None
