"""An engine's KV layout (connector/layout.py): its cache groups and the namespace they key by. What
makes two engines' KV bytes incompatible moves the namespace (the model identity, the attention
kernel's block layout, a hybrid model's groups); layouts the connector cannot load exactly are refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from connector.core.modelidentity import model_identity

from .test_identity import vllm_config


def test_engine_namespace_folds_in_the_model_identity():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from connector.worker.layout import engine_layout

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    kv_cache_config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])], kv_cache_layout=None
    )

    def namespace(cfg, digest=""):
        cfg.parallel_config = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)
        return engine_layout(cfg, kv_cache_config, None, digest).namespace

    base = namespace(vllm_config())
    assert base.model_identity == model_identity(vllm_config())
    assert base.model == "/nonexistent/model"
    assert namespace(vllm_config()) == base
    fp8 = vllm_config(cache={"cache_dtype": "fp8_e5m2"})
    assert namespace(fp8).key_component() != base.key_component()
    assert namespace(vllm_config(), "digest").key_component() != base.key_component()


def test_hybrid_layouts_name_their_groups_and_refuse_what_they_cannot_load_exactly():
    import pytest
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    from connector.core.groups import GroupKind
    from connector.worker.layout import UnsupportedLayout, engine_layout

    full = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=32, dtype=torch.float32)
    mamba = MambaSpec(block_size=64, shapes=((3, 288), (8, 32, 16)), dtypes=(torch.float32, torch.float32))
    window = SlidingWindowSpec(block_size=64, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64)

    def layout(specs, **cache):
        cfg = vllm_config(cache=cache)
        cfg.parallel_config = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)
        groups = [SimpleNamespace(kv_cache_spec=s, layer_names=[f"l{i}"]) for i, s in enumerate(specs)]
        return engine_layout(cfg, SimpleNamespace(kv_cache_groups=groups, kv_cache_layout=None), None, "")

    hybrid = layout([mamba, full], mamba_cache_mode="align")
    assert [g.kind for g in hybrid.groups] == [GroupKind.STATE, GroupKind.FULL]
    assert hybrid.namespace.cache_groups.startswith("state:64;full:64|")
    swa = layout([window, full])
    assert [(g.kind, g.window) for g in swa.groups] == [(GroupKind.SLIDING, 64), (GroupKind.FULL, None)]
    assert swa.namespace.key_component() != layout([full]).namespace.key_component()
    with pytest.raises(UnsupportedLayout, match="align"):
        layout([mamba, full], mamba_cache_mode="none")
    # Sub-block matching on a Mamba model: the producer's L - 1 state (WorkerSide.repair_block_copies).
    assert layout([mamba, full], mamba_cache_mode="align", prefix_match_unit=1).groups == hybrid.groups


def test_speculative_layouts_are_refused_on_hybrid_groups():
    import pytest
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from connector.worker.layout import UnsupportedLayout, engine_layout

    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    window = SlidingWindowSpec(
        block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64, extra_retained_tokens=2
    )
    cfg = vllm_config()
    cfg.parallel_config = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)
    groups = [SimpleNamespace(kv_cache_spec=s, layer_names=[f"l{i}"]) for i, s in enumerate([window, full])]
    with pytest.raises(UnsupportedLayout, match="below its window"):
        engine_layout(cfg, SimpleNamespace(kv_cache_groups=groups, kv_cache_layout=None), None, "")


def _layout(cfg):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from connector.worker.layout import engine_layout

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv_cache_config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])], kv_cache_layout=None
    )
    cfg.parallel_config = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)
    return engine_layout(cfg, kv_cache_config, None, "")


def test_the_attention_kernels_block_layout_moves_the_namespace(monkeypatch):
    """A bf16 producer on an AMX host prepacks its blocks; a consumer on a host without AMX must not
    share its keys (same sizes, same checksums, permuted K/V)."""
    import vllm.v1.attention.backends.cpu_attn as cpu_attn

    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *args: "amx")
    amx = _layout(vllm_config())
    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *args: "vec")
    vec = _layout(vllm_config())
    assert amx.attention == ("CPU_ATTN:amx",) and vec.attention == ("CPU_ATTN:vec",)
    assert amx.namespace.key_component() != vec.namespace.key_component()
    assert amx.namespace.fingerprint() != vec.namespace.fingerprint()


def test_the_worker_refuses_layers_laid_out_otherwise_than_the_namespace_says(monkeypatch):
    import vllm.v1.attention.backends.cpu_attn as cpu_attn

    from connector.worker.layout import UnsupportedLayout, check_attention_layout

    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *args: "vec")
    layout = _layout(vllm_config())

    def engine(isa):
        backend = SimpleNamespace(get_name=lambda: "CPU_ATTN")
        layers = {name: SimpleNamespace(attn_backend=backend, isa=isa) for name in ("l0", "l1")}
        return SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=layers))

    check_attention_layout(engine("vec"), layout)
    with pytest.raises(UnsupportedLayout, match="amx"):
        check_attention_layout(engine("amx"), layout)


def test_tensor_parallel_engines_key_by_their_tp_size_and_pipeline_parallelism_is_refused():
    """A TP engine's layout names rank 0 (the scheduler side's; each worker names its own rank) and
    the TP size, so engines of another TP size, whose ranks hold other heads, never share its keys."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from connector.worker.layout import UnsupportedLayout, engine_layout

    spec = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32)
    kv_cache_config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])], kv_cache_layout=None
    )

    def layout(tp, pp=1, **context):
        cfg = vllm_config()
        cfg.parallel_config = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, **context)
        return engine_layout(cfg, kv_cache_config, None, "")

    one, two = layout(1).namespace, layout(2).namespace
    assert (two.tp_size, two.tp_rank) == (2, 0)
    assert one.key_component() != two.key_component()
    with pytest.raises(UnsupportedLayout, match="pipeline parallelism"):
        layout(1, pp=2)
    # Context parallelism splits a block's tokens across ranks: not keyed, so refused.
    with pytest.raises(UnsupportedLayout, match="decode context parallelism"):
        layout(2, decode_context_parallel_size=2)
    with pytest.raises(UnsupportedLayout, match="prefill context parallelism"):
        layout(2, prefill_context_parallel_size=2)
    assert layout(2, decode_context_parallel_size=1).namespace == two


def test_a_mamba_configuration_that_loses_reuse_is_said_at_start_up():
    from connector.core.groups import CacheGroup, GroupKind
    from connector.worker.layout import state_reuse_warnings

    hybrid = (CacheGroup(0, GroupKind.FULL, 64), CacheGroup(1, GroupKind.STATE, 64))
    plain = (CacheGroup(0, GroupKind.FULL, 64),)
    # The presets: a saving engine with --prefix-match-unit 1, a consumer without it, hash unit 1.
    assert state_reuse_warnings(hybrid, 1, 1, saves=True) == []
    assert state_reuse_warnings(hybrid, 1, None, saves=False) == []
    assert state_reuse_warnings(plain, 16, None, saves=True) == []  # no state group: nothing is lost
    (grid,) = state_reuse_warnings(hybrid, 16, 1, saves=False)
    assert "hash_unit 16" in grid and "hash_unit: 1" in grid
    (stops,) = state_reuse_warnings(hybrid, 1, None, saves=True)
    assert "last multiple of 64" in stops and "--prefix-match-unit 1" in stops
    assert "last multiple of 16" in state_reuse_warnings(hybrid, 1, 16, saves=True)[0]
