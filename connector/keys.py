"""The store's key schema (version 1) and the namespace folded into every key.

    kvtool/1/<namespace>/b/<end_token>/<chain_hash>   a full block ending at token end_token
    kvtool/1/<namespace>/t/<boundary>/<chain_hash>    a partial tail ending at token boundary
    kvtool/1/<namespace>/w/<request_hash>/<seq>       a producer's watermark record for one request

``namespace`` is 16 hex digits of the namespace fingerprint: everything that makes KV bytes
incompatible for the same tokens (model, weights digest, model identity, dtype, layout, block size,
layers, KV heads, head size, TP size and rank, cache group). ``chain_hash`` is 32 hex digits (128
bits). The kind letter and the block/tail domain tags of the hashes keep tail keys and block keys
apart. ``request_hash`` is 32 hex digits of BLAKE2b over the vLLM request id; ``seq`` orders a
request's immutable watermark records (the highest is the latest). Keys use only ``[a-z0-9/]`` so
they survive the master's comma-separated batch queries and URLs unescaped.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from enum import Enum

SCHEMA_VERSION = 1
KEY_PREFIX = f"kvtool/{SCHEMA_VERSION}/"
NAMESPACE_HEX = 16


@dataclass(frozen=True)
class Namespace:
    """Everything that makes stored KV bytes incompatible between two engines."""

    model: str
    dtype: str
    kv_layout: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    tp_size: int = 1
    tp_rank: int = 0
    cache_group: int = 0
    weights_digest: str = ""
    # Digest of everything else about the model that changes KV bytes for the same tokens
    # (connector.identity.model_identity: quantization, revisions, hf_overrides, rope, KV cache
    # dtype, config files, weight file stats). Empty: not known (left out of the fingerprint, so a
    # namespace without it keeps the fingerprint it had before the field existed).
    model_identity: str = ""

    def fingerprint(self) -> bytes:
        fields = asdict(self)
        if not fields["model_identity"]:
            del fields["model_identity"]
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(canonical.encode(), digest_size=16).digest()

    def key_component(self) -> str:
        return self.fingerprint().hex()[:NAMESPACE_HEX]


class KeyKind(str, Enum):
    BLOCK = "b"
    TAIL = "t"
    WATERMARK = "w"


@dataclass(frozen=True)
class DecodedKey:
    """A decoded key. Blocks and tails have ``end_token`` and ``chain_hash``; watermark records have
    ``request_hash`` and ``seq``."""

    namespace: str
    kind: KeyKind
    end_token: int | None = None  # block end or tail boundary: the number of prefix tokens covered
    chain_hash: str | None = None
    request_hash: str | None = None
    seq: int | None = None


_KEY_RE = re.compile(
    rf"^kvtool/(?P<version>\d+)/(?P<ns>[0-9a-f]{{{NAMESPACE_HEX}}})/(?P<kind>[bt])/(?P<end>\d+)/(?P<hash>[0-9a-f]{{32}})$"
)


_WATERMARK_RE = re.compile(
    rf"^kvtool/(?P<version>\d+)/(?P<ns>[0-9a-f]{{{NAMESPACE_HEX}}})/w/(?P<req>[0-9a-f]{{32}})/(?P<seq>\d+)$"
)


def request_hash(request_id: str) -> str:
    return hashlib.blake2b(request_id.encode(), digest_size=16).hexdigest()


def watermark_key(namespace: str, request_id: str, seq: int) -> str:
    return f"{KEY_PREFIX}{namespace}/{KeyKind.WATERMARK.value}/{request_hash(request_id)}/{seq}"


def block_key(namespace: str, end_token: int, chain_hash: bytes) -> str:
    return f"{KEY_PREFIX}{namespace}/{KeyKind.BLOCK.value}/{end_token}/{chain_hash.hex()}"


def tail_key(namespace: str, boundary: int, chain_hash: bytes) -> str:
    return f"{KEY_PREFIX}{namespace}/{KeyKind.TAIL.value}/{boundary}/{chain_hash.hex()}"


def decode_key(key: str) -> DecodedKey | None:
    """Decode one of our keys; None for a key of another schema version or another program."""
    watermark = _WATERMARK_RE.match(key)
    if watermark is not None and int(watermark["version"]) == SCHEMA_VERSION:
        return DecodedKey(
            namespace=watermark["ns"], kind=KeyKind.WATERMARK, request_hash=watermark["req"], seq=int(watermark["seq"])
        )
    match = _KEY_RE.match(key)
    if match is None or int(match["version"]) != SCHEMA_VERSION:
        return None
    return DecodedKey(
        namespace=match["ns"],
        kind=KeyKind(match["kind"]),
        end_token=int(match["end"]),
        chain_hash=match["hash"],
    )
