"""What makes KV differ for the same token ids, per engine: its model identity, folded into the key
namespace (``keys.Namespace``). (Per request, the chain root: ``identity``.)

``model_identity`` reads an engine's ``VllmConfig`` once at start-up: everything that changes the KV
bytes for the same tokens and is cheap to read (quantization, revisions, ``hf_overrides``, rope and
position settings, sliding window, the KV cache dtype, the model's small config files, and the
names, sizes and modification times of its weight files; never the weights themselves). Every
attribute is read defensively: a missing one is recorded as absent, never an error.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import re
import types
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

MODEL_IDENTITY_VERSION = 1

# Hugging Face config attributes that change KV for the same tokens beyond the KV shape (which the
# namespace has from the cache spec): positions (rope and its scaling), attention windows,
# checkpoint quantization (including KV cache schemes and scales).
_HF_KEYS = (
    "architectures",
    "model_type",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "rope_type",
    "partial_rotary_factor",
    "rotary_dim",
    "rotary_emb_base",
    "rotary_pct",
    "position_embedding_type",
    "max_position_embeddings",
    "original_max_position_embeddings",
    "sliding_window",
    "sliding_window_pattern",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "quantization_config",
    "compression_config",
)

_MODEL_KEYS = (
    "dtype",
    "quantization",
    "quantization_config",
    "revision",
    "code_revision",
    "hf_overrides",
    "model_class_overrides",
    "disable_sliding_window",
    "model_weights",
    "convert",
)

# The engine's own multimodal settings change what the model sees (frames sampled, pixels, M-RoPE
# positions) for the same token ids, yet vLLM's item hashes cover only a request's own kwargs.
_MULTIMODAL_KEYS = ("mm_processor_kwargs", "media_io_kwargs", "video_pruning_rate")

_CACHE_KEYS = (
    "cache_dtype",
    "kv_cache_dtype_skip_layers",
    "calculate_kv_scales",  # not in vLLM 0.32 (scales come from the checkpoint); read if present
    "kv_cache_scale",
    "mamba_cache_dtype",
    "mamba_ssm_cache_dtype",
)

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
_CONFIG_FILES = (
    "config.json",
    "params.json",
    "hf_quant_config.json",
    "quantize_config.json",
    "quant_config.json",
)
_CONFIG_MAX_BYTES = 4 << 20
_BLOB_NAME = re.compile(r"^[0-9a-f]{40}$|^[0-9a-f]{64}$")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_ABSENT = "<absent>"


def model_identity(vllm_config: VllmConfig, weights_digest: str = "") -> str:
    """32 hex digits of BLAKE2b over the canonical JSON of ``model_identity_document``."""
    canonical = json.dumps(model_identity_document(vllm_config, weights_digest), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()


def model_identity_document(vllm_config: VllmConfig, weights_digest: str = "") -> dict[str, Any]:
    """Everything read for the model identity, as plain JSON values (for the digest, and to log).

    A user-given ``weights_digest`` (folded into the namespace on its own) replaces the file-stat
    digest of the weights: the user vouches for the weights, so copies of one model on hosts with
    other modification times can share KV. The config-derived parts are always folded in.
    """
    model_config = getattr(vllm_config, "model_config", None)
    cache_config = getattr(vllm_config, "cache_config", None)
    load_config = getattr(vllm_config, "load_config", None)
    document: dict[str, Any] = {
        "v": MODEL_IDENTITY_VERSION,
        "model": _read(model_config, _MODEL_KEYS),
        "cache": _read(cache_config, _CACHE_KEYS),
        "hf": _hf_document(model_config),
        # Another vLLM may compute other KV for the same tokens (its kernels, its defaults): engines
        # share KV only with their own version.
        "vllm": _guard(_vllm_version),
    }
    files = _guard(lambda: _files_document(model_config, load_config, with_weights=not weights_digest))
    document["files"] = files
    # Added where set only, so that every engine without them keeps the namespace it always had.
    if getattr(load_config, "load_format", "auto") == "dummy":
        document["load_format"] = "dummy"  # random weights, with the real model's files on disk
    multimodal = _guard(lambda: _read_set(getattr(model_config, "multimodal_config", None), _MULTIMODAL_KEYS))
    if multimodal:
        document["multimodal"] = multimodal
    overrides = _guard(lambda: _overrides_document(model_config))
    if overrides:
        document["hf_inputs"] = overrides
    return document


def _overrides_document(model_config: Any) -> dict[str, Any] | None:
    """What may make the loaded config differ from the model directory's own files (which
    ``_files_document`` hashes) in a field ``_HF_KEYS`` does not list (a norm's epsilon, an attention
    multiplier): the config files of ``hf_config_path``, and an ``hf_overrides`` function's code
    (``_plain`` names a function only, so two lambdas were one). The inputs, not the loaded config:
    model constructors change that in the worker's process (Falcon, Llama 4, the Transformers backend),
    which would give the scheduler and the worker namespaces of their own. None for an engine with
    neither: it keeps its namespace."""
    document: dict[str, Any] = {}
    path = getattr(model_config, "hf_config_path", None)
    if isinstance(path, str) and path:
        document["hf_config_files"] = _guard(lambda: _config_digests(path))
    overrides = getattr(model_config, "hf_overrides", None)
    if callable(overrides):
        document["hf_overrides_code"] = _guard(lambda: _code_digest(overrides))
    return document or None


def _config_digests(path: str) -> dict[str, str]:
    """Digests of the config files in ``path`` (a directory, or the config file itself)."""
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    digests = _file_digests(directory, _CONFIG_FILES if os.path.isdir(path) else (os.path.basename(path),))
    if not digests:
        return {"unreadable": path}  # a hub id or a remote path: the listed fields still enter
    return digests


def _code_digest(function: Any) -> str:
    """A function's bytecode, constants and names, and the values its closure holds, as a digest (not
    its file name or line numbers: hosts that installed the same code elsewhere agree)."""
    code = getattr(function, "__code__", None)
    if code is None:  # a callable object: its class's ``__call__``
        call = next((vars(k)["__call__"] for k in type(function).__mro__ if "__call__" in vars(k)), None)
        code = getattr(call, "__code__", None)
    if code is None:
        raise TypeError(f"no code for {type(function).__name__}")
    cells = [_plain(cell.cell_contents) for cell in getattr(function, "__closure__", None) or ()]
    canonical = json.dumps([_code_parts(code), cells], sort_keys=True, default=str)
    return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()


def _code_parts(code: types.CodeType) -> list[Any]:
    consts = [_code_parts(c) if isinstance(c, types.CodeType) else _plain(c) for c in code.co_consts]
    return [code.co_code.hex(), consts, list(code.co_names)]


def _vllm_version() -> str:
    from vllm import __version__

    return str(__version__)


def _read_set(obj: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    """``keys`` of ``obj`` that are set (not None, not empty), as plain JSON values."""
    if obj is None:
        return {}
    values = {key: getattr(obj, key, None) for key in keys}
    return {key: _plain(value) for key, value in values.items() if value not in (None, {}, "", [])}


def _read(obj: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    if obj is None:
        return {}
    return {key: _guard(lambda key=key: _plain(getattr(obj, key, _ABSENT))) for key in keys}


def _hf_document(model_config: Any) -> dict[str, Any]:
    def read(config: Any) -> dict[str, Any]:
        return {key: _plain(getattr(config, key)) for key in _HF_KEYS if hasattr(config, key)}

    hf = getattr(model_config, "hf_config", None)
    text = getattr(model_config, "hf_text_config", None)
    document: dict[str, Any] = {}
    if hf is not None:
        document["config"] = _guard(lambda: read(hf))
    if text is not None and text is not hf:
        document["text_config"] = _guard(lambda: read(text))
    long_rope = _guard(lambda: _long_rope(model_config, text if text is not None else hf))
    if long_rope is not None:
        document["longrope_long_factors"] = long_rope
    return document


def _long_rope(model_config: Any, config: Any) -> bool | None:
    """LongRoPE picks its long or short factors from ``max_model_len`` (vLLM's
    phi3_long_rope_scaled_rope), so for those models the choice is part of the KV's identity."""
    if config is None:
        return None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, Mapping):
        return None
    candidates = [rope, *(value for value in rope.values() if isinstance(value, Mapping))]
    if not any(c.get("rope_type", c.get("type")) in ("longrope", "su") for c in candidates):
        return None
    original = getattr(config, "original_max_position_embeddings", None)
    max_model_len = getattr(model_config, "max_model_len", None)
    if original is None or max_model_len is None:
        return None
    return int(max_model_len) > int(original)


def _files_document(model_config: Any, load_config: Any, *, with_weights: bool) -> dict[str, Any] | None:
    directory = _model_directory(model_config, load_config)
    if directory is None:
        return None
    if os.path.isfile(directory):  # a single-file model (GGUF)
        return {"weights": [_file_entry(directory, os.path.basename(directory))] if with_weights else "given"}
    document: dict[str, Any] = {"configs": _file_digests(directory, _CONFIG_FILES)}
    document["weights"] = _weight_entries(directory) if with_weights else "given"
    return document


def _file_digests(directory: str, names: Sequence[str]) -> dict[str, str]:
    """BLAKE2b-128 of each of ``names`` in ``directory`` that is a file of at most ``_CONFIG_MAX_BYTES``."""
    digests = {}
    for name in names:
        path = os.path.join(directory, name)
        if os.path.isfile(path) and os.path.getsize(path) <= _CONFIG_MAX_BYTES:
            with open(path, "rb") as handle:
                digests[name] = hashlib.blake2b(handle.read(), digest_size=16).hexdigest()
    return digests


def _model_directory(model_config: Any, load_config: Any) -> str | None:
    """The local directory (or file) the model was read from: the path given, else the Hugging Face
    cache snapshot of the model id at its revision (looked up in the local cache only)."""
    model = getattr(model_config, "model", None)
    if not isinstance(model, str) or not model:
        return None
    if os.path.exists(model):
        return model
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(
        model,
        "config.json",
        cache_dir=getattr(load_config, "download_dir", None),
        revision=getattr(model_config, "revision", None),
    )
    return os.path.dirname(found) if isinstance(found, str) else None


def _weight_entries(directory: str) -> list[list[Any]]:
    entries = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            if name.endswith(_WEIGHT_SUFFIXES):
                path = os.path.join(root, name)
                entries.append(_file_entry(path, os.path.relpath(path, directory)))
    return sorted(entries)


def _file_entry(path: str, name: str) -> list[Any]:
    """Name, size, and either the Hugging Face cache blob the file links to (its content hash, the
    same on every host) or its modification time in whole seconds."""
    stat = os.stat(path)
    if os.path.islink(path):
        target = os.path.basename(os.readlink(path))
        if _BLOB_NAME.match(target):
            return [name, stat.st_size, f"blob:{target}"]
    return [name, stat.st_size, int(stat.st_mtime)]


def _guard(read: Any) -> Any:
    """Runs a read; a failure is recorded by its exception type, never raised into the engine."""
    try:
        return read()
    except Exception as exc:  # noqa: BLE001 - identity reads must never crash the engine
        return {"unreadable": type(exc).__name__}


def _plain(value: Any, depth: int = 0) -> Any:
    """A deterministic JSON value for ``value`` (no memory addresses, sorted sets)."""
    if depth > 12:
        return "<deep>"
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else repr(value)
    if isinstance(value, enum.Enum):
        return _plain(value.value, depth + 1)
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, Mapping):
        return {str(key): _plain(item, depth + 1) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item, depth + 1) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_plain(item, depth + 1) for item in value), key=lambda item: json.dumps(item, sort_keys=True))
    if type(value).__module__ == "torch" or type(value).__name__ == "dtype":
        return str(value)
    if hasattr(value, "model_dump"):  # pydantic models (vLLM's QuantizationConfigArgs)
        return _plain(value.model_dump(), depth + 1)
    if hasattr(value, "to_dict"):  # transformers' configs and quantization configs
        return _plain(value.to_dict(), depth + 1)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain({f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, depth + 1)
    if callable(value):  # e.g. an hf_overrides function
        return f"<callable {getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}>"
    return _ADDRESS.sub("", repr(value))
