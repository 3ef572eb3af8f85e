"""An engine's KV layout, read once from vLLM's configuration and shared by both sides: its cache
groups (``connector.core.groups``) and the namespace of its stored KV."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.groups import CacheGroup, GroupKind, describe_groups
from ..core.modelidentity import model_identity
from ..core.keys import MAX_GROUP, Namespace
from ..core.tokencut import CUTTABLE

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec


class UnsupportedLayout(Exception):
    """The engine's KV cache is of a shape this connector does not handle; it runs disabled."""


@dataclass(frozen=True)
class EngineLayout:
    namespace: Namespace
    groups: tuple[CacheGroup, ...]
    layer_names: tuple[tuple[str, ...], ...]  # per group
    # Per group: the attention kernel's block layout (attention_layout), None for a state group.
    attention: tuple[str | None, ...] = ()
    block_bytes: tuple[int, ...] = ()  # per group: one block across its layers (what an object holds)
    # Per group: bytes a token takes across its layers where its tails hold their valid tokens only
    # (connector.core.tokencut), else 0 (its tails are whole blocks).
    token_bytes: tuple[int, ...] = ()


def attention_layout(vllm_config: VllmConfig, spec: object) -> str:
    """What decides how an attention block's interior is laid out in memory, beyond its shape: the
    backend, and on the CPU the kernel's ISA, which vLLM picks per host (``amx`` prepacks bf16 blocks,
    ``neon`` on ARM, ``vec``/``vec16`` otherwise). Two engines whose blocks have the same size and
    checksum but another layout would read each other's K/V permuted: the namespace must tell them apart."""
    from vllm.platforms import current_platform

    if current_platform.device_type == "cpu":
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            isa = _get_attn_isa(spec.dtype, spec.block_size, spec.head_size, vllm_config.cache_config.cache_dtype)
        except Exception as exc:  # noqa: BLE001 - a private vLLM helper: never guess the layout
            raise UnsupportedLayout(f"cannot tell the CPU attention kernel's block layout ({exc})") from None
        return f"CPU_ATTN:{isa}"
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    if backend is None:
        raise UnsupportedLayout(
            f"the attention backend on {current_platform.device_type} is chosen at start-up; name it "
            "(--attention-backend) so that the namespace carries its KV layout"
        )
    return str(getattr(backend, "name", backend))


def check_attention_layout(vllm_config: VllmConfig, layout: EngineLayout) -> None:
    """The worker's attention layers must use the layout the namespace names (the scheduler side
    derives it from the configuration; the worker sees what vLLM really chose)."""
    context = vllm_config.compilation_config.static_forward_context
    for names, expected in zip(layout.layer_names, layout.attention, strict=True):
        if expected is None:
            continue
        for name in names:
            layer = context.get(name)
            backend = getattr(layer, "attn_backend", None)
            if backend is None:
                raise UnsupportedLayout(f"layer {name} has no attention backend to check the KV layout against")
            isa = getattr(layer, "isa", None)
            actual = f"{backend.get_name()}:{isa}" if isa else backend.get_name()
            if actual != expected:
                raise UnsupportedLayout(f"layer {name} lays out KV as {actual}, not {expected} as the namespace says")


def _group_kind(index: int, group: KVCacheGroupSpec) -> CacheGroup:
    """What vLLM's KV cache manager does with a group's blocks decides how it is saved and loaded."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, MambaManager, SlidingWindowManager
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    spec = group.kv_cache_spec
    manager = KVCacheSpecRegistry.get_manager_class(spec, getattr(group, "role", None))
    if manager is FullAttentionManager:  # a sliding window folded into full attention keeps every block
        return CacheGroup(index, GroupKind.FULL, spec.block_size)
    if manager is SlidingWindowManager:
        return CacheGroup(index, GroupKind.SLIDING, spec.block_size, window=spec.sliding_window)
    if manager is MambaManager:
        return CacheGroup(index, GroupKind.STATE, spec.block_size)
    kind = manager.__name__ if manager is not None else "no manager"
    raise UnsupportedLayout(f"KV cache group {index} ({type(spec).__name__}, {kind}) is not supported yet")


def engine_layout(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, model_id: str | None, weights_digest: str
) -> EngineLayout:
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import AttentionSpec

    specs = kv_cache_config.kv_cache_groups
    if not specs:
        raise UnsupportedLayout("the engine has no KV cache groups")
    if len(specs) > MAX_GROUP + 1:
        raise UnsupportedLayout(f"{len(specs)} KV cache groups")
    if any(not getattr(g, "enable_kv_transfer", True) or getattr(g, "is_eagle_group", False) for g in specs):
        raise UnsupportedLayout("draft-model (EAGLE/MTP) or non-transferable KV cache groups are not supported yet")
    groups = tuple(_group_kind(index, group) for index, group in enumerate(specs))
    for group, spec in zip(groups, (g.kv_cache_spec for g in specs), strict=True):
        # Speculative decoding keeps extra blocks below a window, or moves a Mamba state to another
        # block: what a hit needs is then not what connector.core.groups computes. Never guess.
        if group.kind is GroupKind.SLIDING and getattr(spec, "extra_retained_tokens", 0):
            raise UnsupportedLayout(f"KV cache group {group.index} keeps blocks below its window (spec decoding)")
        if group.kind is GroupKind.STATE and getattr(spec, "num_speculative_blocks", 0):
            raise UnsupportedLayout(f"KV cache group {group.index} has speculative Mamba blocks")
    if any(group.kind is GroupKind.STATE for group in groups):
        cache = vllm_config.cache_config
        mode = getattr(cache, "mamba_cache_mode", None)
        if mode != "align":
            # Only align mode keeps a state per block boundary, in the block of its last token.
            raise UnsupportedLayout(f"Mamba cache mode {mode!r} (kvtool needs --mamba-cache-mode align)")
        # Sub-block matching (--prefix-match-unit below the block size) is supported: a producer's
        # prefill then stops at the prompt's last checkpoint (L - 1 with a unit of 1) and vLLM offers
        # that state's exact block (boundary_state_offloads) in the step that completes the prompt; the
        # state after the whole prompt stays in the block of its last token. Its sub-block local hits
        # need the worker's repair of vLLM's copy-on-write copies (WorkerSide.repair_block_copies).
    block_sizes = {group.block_size for group in groups}
    if len(block_sizes) != 1:
        raise UnsupportedLayout(f"KV cache groups of different block sizes ({sorted(block_sizes)})")
    parallel = vllm_config.parallel_config
    _check_parallelism(parallel)
    # The namespace names the first attention group's layout; a hybrid model adds every group's.
    attention = next((g for g in specs if isinstance(g.kv_cache_spec, AttentionSpec)), None)
    if attention is None:
        raise UnsupportedLayout("a model without attention layers is not supported")
    spec = attention.kv_cache_spec
    kernels = tuple(
        attention_layout(vllm_config, g.kv_cache_spec) if isinstance(g.kv_cache_spec, AttentionSpec) else None
        for g in specs
    )
    kernel_tags = ",".join(sorted({tag for tag in kernels if tag is not None}))
    # Tails cut to their valid tokens are other bytes under the same keys: the namespace says so.
    quantized = str(vllm_config.cache_config.cache_dtype).startswith("fp8")  # tokencut.CUT_DTYPES
    cut = tuple(tag in CUTTABLE and not quantized for tag in kernels)
    layout = (
        f"{current_platform.device_type}:{type(spec).__name__}:{kv_cache_config.kv_cache_layout or 'default'}"
        f":{kernel_tags}{':tails-cut' if any(cut) else ''}"
    )
    namespace = Namespace(
        model=model_id or vllm_config.model_config.model,
        dtype=str(spec.dtype).removeprefix("torch."),
        kv_layout=layout,
        block_size=spec.block_size,
        num_layers=sum(len(group.layer_names) for group in specs),
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        tp_size=parallel.tensor_parallel_size,
        tp_rank=0,  # the scheduler side's; each worker names its own (connector.core.ranks)
        cache_group=0,
        weights_digest=weights_digest,
        model_identity=model_identity(vllm_config, weights_digest),
        cache_groups=_describe_specs(groups, specs),
    )
    block_bytes = tuple(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in specs)
    token_bytes = tuple(
        size // g.kv_cache_spec.block_size if c else 0 for size, g, c in zip(block_bytes, specs, cut, strict=True)
    )
    layer_names = tuple(tuple(group.layer_names) for group in specs)
    return EngineLayout(namespace, groups, layer_names, kernels, block_bytes, token_bytes)


def state_reuse_warnings(
    groups: tuple[CacheGroup, ...], hash_unit: int, prefix_match_unit: int | None, saves: bool
) -> list[str]:
    """What a model with state (Mamba) groups loses on this configuration, one sentence each (said at
    start-up): a hit there needs a state after exactly its length, which exists only where a prefill
    stopped (block boundaries, the prompt's last checkpoint, the prompt's and an answer's end), and
    attention objects reaching that end (tails on the ``hash_unit`` grid)."""
    if not any(group.kind is GroupKind.STATE for group in groups):
        return []
    warnings = []
    if hash_unit > 1:
        warnings.append(
            f"hash_unit {hash_unit} on a model with state (Mamba) layers: a stored prompt's end is a hit only "
            f"where it falls on that grid (its state is kept at its exact end, its tail at the grid point "
            f"before), so most prompts repeating or extending a stored one reuse its whole blocks only; set "
            f"hash_unit: 1"
        )
    unit = prefix_match_unit or groups[0].block_size
    if saves and unit > 1:
        warnings.append(
            f"this engine's prefill stops at block boundaries and at one checkpoint, the last multiple of "
            f"{unit} (--prefix-match-unit, else the block size) below a prompt's length, so it saves no state "
            f"one token short of the prompt: the same prompt sent again reuses only up to that checkpoint; "
            f"give the engine --prefix-match-unit 1"
        )
    return warnings


def _check_parallelism(parallel: object) -> None:
    """Tensor parallelism is keyed per rank (``connector.core.ranks``); other splits of the KV are refused."""
    if getattr(parallel, "pipeline_parallel_size", 1) != 1:
        # A rank then holds some layers' KV of the prompt: not what a namespace per TP rank describes.
        raise UnsupportedLayout("pipeline parallelism above 1 is not supported yet")
    for kind in ("decode", "prefill"):
        # A rank then holds an interleaved share of each block's tokens (and ranks of different
        # context groups share a TP rank): neither is in the namespace.
        if (getattr(parallel, f"{kind}_context_parallel_size", 1) or 1) != 1:
            raise UnsupportedLayout(f"{kind} context parallelism above 1 is not supported yet")


def _describe_specs(groups: tuple[CacheGroup, ...], specs: list[KVCacheGroupSpec]) -> str:
    """The groups, plus each one's layer count and page size (what a reader's blocks must match)."""
    described = describe_groups(groups)
    if not described:
        return ""
    pages = ";".join(f"{len(s.layer_names)}x{s.kv_cache_spec.page_size_bytes}" for s in specs)
    return f"{described}|{pages}"
