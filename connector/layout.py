"""The namespace of an engine's KV: read once from vLLM's configuration, shared by both sides."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .identity import model_identity
from .keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class UnsupportedLayout(Exception):
    """The engine's KV cache is of a shape this connector does not handle; it runs disabled."""


def engine_namespace(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, model_id: str | None, weights_digest: str
) -> Namespace:
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import AttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedLayout(f"{len(groups)} KV cache groups (hybrid models are not supported yet)")
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, AttentionSpec):
        raise UnsupportedLayout(f"KV cache spec {type(spec).__name__} is not plain attention")
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise UnsupportedLayout("tensor or pipeline parallelism above 1 is not supported yet")
    layout = f"{current_platform.device_type}:{type(spec).__name__}:{kv_cache_config.kv_cache_layout or 'default'}"
    return Namespace(
        model=model_id or vllm_config.model_config.model,
        dtype=str(spec.dtype).removeprefix("torch."),
        kv_layout=layout,
        block_size=spec.block_size,
        num_layers=len(groups[0].layer_names),
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        tp_size=parallel.tensor_parallel_size,
        tp_rank=0,
        cache_group=0,
        weights_digest=weights_digest,
        model_identity=model_identity(vllm_config, weights_digest),
    )
