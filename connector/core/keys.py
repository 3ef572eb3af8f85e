"""The store's key schema (version 2) and the namespace folded into every key.

    kvtool/2/<namespace>/<group>/b/<end_token>/<chain_hash>   a full block ending at token end_token
    kvtool/2/<namespace>/<group>/t/<boundary>/<chain_hash>    a partial tail ending at token boundary
    kvtool/2/<namespace>/<group>/s/<boundary>/<chain_hash>    a state group's state after boundary tokens
    kvtool/2/<namespace>/<group>/p/<boundary>/<chain_hash>    a pointer: the block or tail object that holds
                                                              the KV of the prefix ending at boundary
    kvtool/2/<namespace>/w/<request_hash>/<seq>               a producer's watermark record for one request

``group`` is the KV cache group (decimal, 0 for a model with one group): a hybrid model's sliding-window,
full-attention and Mamba layers are saved and loaded per group, each from its own blocks.

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

SCHEMA_VERSION = 2
KEY_PREFIX = f"kvtool/{SCHEMA_VERSION}/"
NAMESPACE_HEX = 16
MAX_GROUP = 255  # the object header stores the group in one byte


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
    cache_group: int = 0  # always 0 since schema 2: the key and the object header carry the group
    weights_digest: str = ""
    # Digest of everything else about the model that changes KV bytes for the same tokens
    # (connector.core.modelidentity.model_identity: quantization, revisions, hf_overrides, rope, KV cache
    # dtype, config files, weight file stats). Empty: not known (left out of the fingerprint, so a
    # namespace without it keeps the fingerprint it had before the field existed).
    model_identity: str = ""
    # A hybrid model's KV cache groups, in order (connector.core.groups.describe_groups); empty for a model
    # with one group of plain attention (left out of the fingerprint, like model_identity).
    cache_groups: str = ""

    def fingerprint(self) -> bytes:
        fields = asdict(self)
        for optional in ("model_identity", "cache_groups"):
            if not fields[optional]:
                del fields[optional]
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(canonical.encode(), digest_size=16).digest()

    def key_component(self) -> str:
        return self.fingerprint().hex()[:NAMESPACE_HEX]


class KeyKind(str, Enum):
    BLOCK = "b"
    TAIL = "t"
    STATE = "s"  # a recurrent (Mamba) group's state after end_token tokens
    POINTER = "p"  # names the stored block or tail that holds a prefix ending inside it (a divergence point)
    WATERMARK = "w"


@dataclass(frozen=True)
class DecodedKey:
    """A decoded key. Blocks, tails and states have ``group``, ``end_token`` and ``chain_hash``; watermark
    records have ``request_hash`` and ``seq``."""

    namespace: str
    kind: KeyKind
    end_token: int | None = None  # block end or tail boundary: the number of prefix tokens covered
    group: int | None = None
    chain_hash: str | None = None
    request_hash: str | None = None
    seq: int | None = None


_KEY_RE = re.compile(
    rf"^kvtool/(?P<version>\d+)/(?P<ns>[0-9a-f]{{{NAMESPACE_HEX}}})/(?P<group>\d{{1,3}})/(?P<kind>[btsp])/(?P<end>\d+)/"
    r"(?P<hash>[0-9a-f]{32})$"
)


_WATERMARK_RE = re.compile(
    rf"^kvtool/(?P<version>\d+)/(?P<ns>[0-9a-f]{{{NAMESPACE_HEX}}})/w/(?P<req>[0-9a-f]{{32}})/(?P<seq>\d+)$"
)


def request_hash(request_id: str) -> str:
    return hashlib.blake2b(request_id.encode(), digest_size=16).hexdigest()


def watermark_key(namespace: str, request_id: str, seq: int) -> str:
    return f"{KEY_PREFIX}{namespace}/{KeyKind.WATERMARK.value}/{request_hash(request_id)}/{seq}"


# Each object kind's letter (an enum's ``.value`` is a descriptor call: a lookup builds hundreds of keys).
_LETTER = {kind: kind.value for kind in KeyKind if kind is not KeyKind.WATERMARK}


def object_key(namespace: str, group: int, kind: KeyKind, end_token: int, chain_hash: bytes) -> str:
    """The key of a block, tail or state object of one cache group."""
    return f"{object_key_prefix(namespace, group, kind)}{end_token}/{chain_hash.hex()}"


def object_key_prefix(namespace: str, group: int, kind: KeyKind) -> str:
    """What every key of one kind in one group starts with (``object_key``: then the end and the hash)."""
    letter = _LETTER.get(kind)
    if letter is None or not 0 <= group <= MAX_GROUP:
        raise ValueError(f"no object key for kind {kind.name} in group {group}")
    return f"{KEY_PREFIX}{namespace}/{group}/{letter}/"


def block_key(namespace: str, end_token: int, chain_hash: bytes, group: int = 0) -> str:
    return object_key(namespace, group, KeyKind.BLOCK, end_token, chain_hash)


def tail_key(namespace: str, boundary: int, chain_hash: bytes, group: int = 0) -> str:
    return object_key(namespace, group, KeyKind.TAIL, boundary, chain_hash)


def state_key(namespace: str, boundary: int, chain_hash: bytes, group: int) -> str:
    return object_key(namespace, group, KeyKind.STATE, boundary, chain_hash)


def decode_key(key: str) -> DecodedKey | None:
    """Decode one of our keys; None for a key of another schema version or another program."""
    watermark = _WATERMARK_RE.match(key)
    if watermark is not None and int(watermark["version"]) == SCHEMA_VERSION:
        return DecodedKey(
            namespace=watermark["ns"], kind=KeyKind.WATERMARK, request_hash=watermark["req"], seq=int(watermark["seq"])
        )
    match = _KEY_RE.match(key)
    if match is None or int(match["version"]) != SCHEMA_VERSION or int(match["group"]) > MAX_GROUP:
        return None
    return DecodedKey(
        namespace=match["ns"],
        kind=KeyKind(match["kind"]),
        end_token=int(match["end"]),
        chain_hash=match["hash"],
        group=int(match["group"]),
    )
