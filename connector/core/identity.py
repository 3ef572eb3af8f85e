"""What makes KV differ for the same token ids, per request: the chain root. (Per engine, the namespace:
``modelidentity``.)

``request_identity`` reads a vLLM ``Request``: its ``cache_salt``, LoRA adapter (name and path),
multimodal inputs (identifier and placeholder position) and prompt embeddings (a digest of the
tensor, and of the mask saying which positions are embeddings). A prompt with embeddings has
placeholder token ids at the embedded positions, so without the digest it would share keys with a
text prompt of the same ids.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import TYPE_CHECKING, Any

from .hashing import HASH_BYTES, RequestIdentity

if TYPE_CHECKING:
    from vllm.v1.request import Request

_EMBEDS_TAG = b"kvtool-embeds-v1"


class UnhashableRequest(Exception):
    """The request's identity cannot be read (e.g. its prompt embeddings are not a readable tensor).

    The caller must neither look the request up nor store it: without its full identity its keys
    could collide with another request's.
    """


def request_identity(request: Request) -> RequestIdentity:
    """The identity of ``request`` besides its tokens; raises ``UnhashableRequest`` when unreadable."""
    lora = getattr(request, "lora_request", None)
    features = getattr(request, "mm_features", None) or []
    try:
        mm_hashes = tuple(_mm_hash(feature) for feature in features)
    except Exception as exc:  # noqa: BLE001 - any unreadable feature makes the request unhashable
        raise UnhashableRequest(f"multimodal input unreadable: {type(exc).__name__}: {exc}") from exc
    embeds = getattr(request, "prompt_embeds", None)
    return RequestIdentity(
        cache_salt=getattr(request, "cache_salt", None),
        lora_name=getattr(lora, "lora_name", None) if lora is not None else None,
        mm_hashes=mm_hashes,
        lora_path=(getattr(lora, "lora_path", None) or None) if lora is not None else None,
        embeds_digest=(
            embeddings_digest(embeds, getattr(request, "prompt_is_token_ids", None)) if embeds is not None else None
        ),
    )


def prompt_tokens(request: Request) -> list[int]:
    """The prompt's token ids as its KV was computed: in a mixed prompt (``prompt_is_token_ids``) the
    embedded positions carry placeholder ids of any value (-1 included), which vLLM zeroes before the
    forward pass; the chain root digests the embeddings and that mask, so zeros key them exactly."""
    ids = getattr(request, "prompt_token_ids", None) or []
    mask = getattr(request, "prompt_is_token_ids", None)
    if mask is None:
        return list(ids)
    return [token if is_token else 0 for token, is_token in zip(ids, mask, strict=False)]


def identity_size(request: Request) -> tuple[int, int]:
    """What grows when vLLM resumes a request as a streaming-input session (``prompt_token_ids``
    extended, multimodal features appended): compared on every use, it tells stale keys."""
    return len(getattr(request, "prompt_token_ids", None) or ()), len(getattr(request, "mm_features", None) or ())


def _mm_hash(feature: Any) -> str:
    """A multimodal input's identifier and where its placeholder lies (vLLM's own prefix cache keys
    on the position too: the same item at another offset is other KV)."""
    identifier = feature.identifier
    if identifier is None:
        raise ValueError("multimodal feature without an identifier")
    position = getattr(feature, "mm_position", None)
    if position is None:
        return str(identifier)
    return f"{identifier}@{int(position.offset)}+{int(position.length)}"


def embeddings_digest(embeds: Any, is_token_ids: Any = None) -> bytes:
    """BLAKE2b-128 over the embeddings tensor's dtype, shape and raw bytes (copied to the CPU), and
    the mixed-mode mask of positions that hold token ids (``None`` when every position is embedded).

    Raises ``UnhashableRequest`` when the tensor cannot be read.
    """
    try:
        import torch

        if not isinstance(embeds, torch.Tensor):
            raise TypeError(f"prompt_embeds is a {type(embeds).__name__}, not a tensor")
        tensor = embeds.detach()
        if tensor.layout != torch.strided:
            tensor = tensor.to_dense()
        tensor = tensor.cpu().contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy()
        h = hashlib.blake2b(digest_size=HASH_BYTES)
        for part in (_EMBEDS_TAG, str(tensor.dtype).encode(), json.dumps(list(tensor.shape)).encode()):
            h.update(struct.pack("<I", len(part)))
            h.update(part)
        if is_token_ids is None:
            h.update(b"\x00")
        else:
            mask = bytes(1 if bool(flag) else 0 for flag in is_token_ids)
            h.update(b"\x01" + struct.pack("<Q", len(mask)) + mask)
        h.update(struct.pack("<Q", raw.nbytes))
        h.update(memoryview(raw))
        return h.digest()
    except UnhashableRequest:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the tensor is, unreadable means unhashable
        raise UnhashableRequest(f"prompt embeddings unreadable: {type(exc).__name__}: {exc}") from exc
