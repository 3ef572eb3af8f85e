"""Identity gaps (issue 8): two engines or two requests whose KV differs for the same token ids never
share keys. Engine side: every input of the model identity moves the namespace. Request side:
prompt embeddings (and LoRA paths, multimodal positions) move the chain root; a plain text request
keeps the root it always had."""

from __future__ import annotations

import copy
import os
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.hashing import RequestIdentity
from connector.identity import (
    UnhashableRequest,
    embeddings_digest,
    model_identity,
    model_identity_document,
    request_identity,
)
from connector.keys import Namespace

# -- engine side: fake vllm_config objects mirroring the attributes read ----------------------------


def hf_config(**overrides):
    fields = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        max_position_embeddings=2048,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


def vllm_config(model="/nonexistent/model", hf=None, cache=None, **model_fields):
    hf = hf if hf is not None else hf_config()
    fields = dict(
        model=model,
        dtype=torch.bfloat16,
        quantization=None,
        quantization_config=None,
        revision=None,
        code_revision=None,
        hf_overrides={},
        model_class_overrides={},
        disable_sliding_window=False,
        model_weights="",
        convert="auto",
        max_model_len=512,
        hf_config=hf,
        hf_text_config=hf,
    )
    fields.update(model_fields)
    cache_fields = dict(cache_dtype="auto", kv_cache_dtype_skip_layers=[], mamba_cache_dtype="auto")
    cache_fields.update(cache or {})
    return SimpleNamespace(
        model_config=SimpleNamespace(**fields),
        cache_config=SimpleNamespace(**cache_fields),
        load_config=SimpleNamespace(download_dir=None),
    )


def _set_hf(cfg, **fields):
    for name, value in fields.items():
        setattr(cfg.model_config.hf_config, name, value)
    return cfg


# name -> a change of one identity input (applied to a fresh base configuration)
CHANGES = {
    "quantization": lambda c: setattr(c.model_config, "quantization", "fp8"),
    "quantization_config": lambda c: setattr(c.model_config, "quantization_config", {"weight_block_size": [128, 128]}),
    "hf_quantization_config": lambda c: _set_hf(c, quantization_config={"quant_method": "awq", "bits": 4}),
    "kv_cache_scheme": lambda c: _set_hf(
        c, quantization_config={"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8}}
    ),
    "revision": lambda c: setattr(c.model_config, "revision", "abc123"),
    "code_revision": lambda c: setattr(c.model_config, "code_revision", "v2"),
    "hf_overrides": lambda c: setattr(c.model_config, "hf_overrides", {"rope_theta": 500000.0}),
    "hf_overrides_callable": lambda c: setattr(c.model_config, "hf_overrides", _override_fn),
    "rope_scaling": lambda c: _set_hf(c, rope_parameters={"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0}),
    "rope_scaling_legacy": lambda c: _set_hf(c, rope_scaling={"type": "linear", "factor": 2.0}),
    "rope_theta": lambda c: _set_hf(c, rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}),
    "rope_theta_top_level": lambda c: _set_hf(c, rope_theta=1e6),
    "partial_rotary_factor": lambda c: _set_hf(c, partial_rotary_factor=0.5),
    "max_position_embeddings": lambda c: _set_hf(c, max_position_embeddings=4096),
    "sliding_window": lambda c: _set_hf(c, sliding_window=1024),
    "disable_sliding_window": lambda c: setattr(c.model_config, "disable_sliding_window", True),
    "model_dtype": lambda c: setattr(c.model_config, "dtype", torch.float16),
    "kv_cache_dtype": lambda c: setattr(c.cache_config, "cache_dtype", "fp8_e4m3"),
    "kv_cache_dtype_skip_layers": lambda c: setattr(c.cache_config, "kv_cache_dtype_skip_layers", ["0"]),
    "calculate_kv_scales": lambda c: setattr(c.cache_config, "calculate_kv_scales", True),
    "model_class_overrides": lambda c: setattr(c.model_config, "model_class_overrides", {"Llama": "my:Llama"}),
}


def _override_fn(config):
    return config


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_each_identity_input_moves_the_namespace(name):
    base, changed = vllm_config(), vllm_config()
    CHANGES[name](changed)
    assert model_identity(changed) != model_identity(base), name
    assert _namespace(changed).key_component() != _namespace(base).key_component(), name


def test_identical_configurations_give_identical_identities():
    assert model_identity(vllm_config()) == model_identity(vllm_config())
    assert _namespace(vllm_config()) == _namespace(vllm_config())


def test_fp8_variants_differ():
    variants = {"auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "bfloat16"}
    identities = {model_identity(vllm_config(cache={"cache_dtype": v})) for v in variants}
    assert len(identities) == len(variants)


# Changes that set the same attribute (the last one wins); every other pair is independent.
SLOTS = {
    "hf_quantization_config": "hf.quantization_config",
    "kv_cache_scheme": "hf.quantization_config",
    "hf_overrides": "hf_overrides",
    "hf_overrides_callable": "hf_overrides",
    "rope_scaling": "hf.rope_parameters",
    "rope_theta": "hf.rope_parameters",
}


@settings(max_examples=60, deadline=None)
@given(applied=st.sets(st.sampled_from(sorted(CHANGES))), extra=st.sampled_from(sorted(CHANGES)))
def test_every_further_change_moves_the_identity(applied, extra):
    slots = {SLOTS.get(name, name) for name in applied}
    if SLOTS.get(extra, extra) in slots:
        return

    def build(names):
        cfg = vllm_config()
        for name in sorted(names):
            CHANGES[name](cfg)
        return model_identity(cfg)

    assert build(applied) == build(set(applied))
    assert build(applied | {extra}) != build(applied)


@settings(max_examples=40, deadline=None)
@given(
    overrides=st.dictionaries(
        st.sampled_from(["rope_theta", "max_position_embeddings", "sliding_window", "head_dim"]),
        st.one_of(st.integers(1, 10**6), st.floats(allow_nan=False, allow_infinity=False)),
        max_size=3,
    )
)
def test_hf_overrides_are_part_of_the_identity(overrides):
    with_overrides = model_identity(vllm_config(hf_overrides=overrides))
    assert with_overrides == model_identity(vllm_config(hf_overrides=dict(overrides)))
    assert (with_overrides == model_identity(vllm_config())) == (overrides == {})


def test_longrope_folds_in_the_long_factor_choice():
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0], "long_factor": [4.0]}

    def build(max_model_len):
        cfg = vllm_config(max_model_len=max_model_len)
        return _set_hf(cfg, rope_parameters=rope, original_max_position_embeddings=4096)

    assert model_identity(build(2048)) == model_identity(build(4096))  # short factors both
    assert model_identity(build(2048)) != model_identity(build(8192))  # long factors
    # Without LongRoPE, max_model_len is not part of the identity.
    assert model_identity(vllm_config(max_model_len=512)) == model_identity(vllm_config(max_model_len=8192))


def test_missing_or_failing_attributes_never_crash():
    class Exploding:
        @property
        def quantization(self):
            raise RuntimeError("boom")

    for cfg in (
        SimpleNamespace(),
        SimpleNamespace(model_config=None, cache_config=None),
        SimpleNamespace(model_config=SimpleNamespace(model=42), cache_config=SimpleNamespace()),
        SimpleNamespace(model_config=Exploding(), cache_config=SimpleNamespace(cache_dtype="auto")),
        vllm_config(model="not a valid repo id!!"),
    ):
        first, second = model_identity(cfg), model_identity(cfg)
        assert first == second and len(first) == 32


def test_unknown_objects_are_canonical_without_memory_addresses():
    class Opaque:
        pass

    a = model_identity(vllm_config(quantization_config=Opaque()))
    b = model_identity(vllm_config(quantization_config=Opaque()))
    assert a == b


# -- weights files ----------------------------------------------------------------------------------


def _model_dir(path, shards=2):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    (path / "tokenizer.json").write_text("{}")
    for i in range(shards):
        (path / f"model-{i:05d}-of-{shards:05d}.safetensors").write_bytes(b"w" * (100 + i))
    (path / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    _stamp(path, 1_700_000_000)
    return path


def _stamp(path, when):
    for entry in path.rglob("*"):
        os.utime(entry, (when, when), follow_symlinks=False)


def _ident(path, weights_digest=""):
    return model_identity(vllm_config(model=str(path)), weights_digest)


def test_weight_file_stats_move_the_identity(tmp_path):
    base = _ident(_model_dir(tmp_path / "m"))
    assert base == _ident(tmp_path / "m")  # nothing changed
    # The same files in another directory: the same identity (the path itself is Namespace.model).
    assert _ident(_model_dir(tmp_path / "copy")) == base

    cases = {
        "size": lambda p: (p / "model-00000-of-00002.safetensors").write_bytes(b"w" * 101),
        "mtime": lambda p: os.utime(p / "model-00001-of-00002.safetensors", (1_800_000_000, 1_800_000_000)),
        "renamed": lambda p: (p / "model-00001-of-00002.safetensors").rename(p / "other.safetensors"),
        "extra shard": lambda p: (p / "extra.bin").write_bytes(b"x"),
        "index": lambda p: (p / "model.safetensors.index.json").write_text('{"weight_map": {"a": "b"}}'),
        "config.json": lambda p: (p / "config.json").write_text('{"model_type": "llama", "hidden_size": 65}'),
    }
    for name, change in cases.items():
        path = _model_dir(tmp_path / name.replace(" ", "_"))
        change(path)
        if name not in ("mtime",):
            # Keep the modification times equal so that only the change itself can move the identity.
            _stamp(path, 1_700_000_000)
        assert _ident(path) != base, name


def test_files_that_do_not_hold_weights_do_not_move_it(tmp_path):
    path = _model_dir(tmp_path / "m")
    base = _ident(path)
    (path / "tokenizer.json").write_text('{"changed": true}')
    (path / "README.md").write_text("hello")
    assert _ident(path) == base


def test_weights_are_never_read(tmp_path, monkeypatch):
    path = _model_dir(tmp_path / "m")
    opened = []
    real_open = open

    def spy(file, *args, **kwargs):
        opened.append(os.fspath(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", spy)
    _ident(path)
    assert opened and not [f for f in opened if f.endswith((".safetensors", ".bin"))]


def test_a_given_weights_digest_replaces_the_file_stats(tmp_path):
    path = _model_dir(tmp_path / "m")
    base = _ident(path, "sha-of-weights")
    os.utime(path / "model-00000-of-00002.safetensors", (1_800_000_000, 1_800_000_000))
    assert _ident(path, "sha-of-weights") == base  # the user vouches for the weights
    (path / "config.json").write_text('{"model_type": "llama", "hidden_size": 65}')
    assert _ident(path, "sha-of-weights") != base  # the config still counts


def test_single_file_model(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"g" * 10)
    os.utime(gguf, (1_700_000_000, 1_700_000_000))
    base = _ident(gguf)
    gguf.write_bytes(b"g" * 11)
    os.utime(gguf, (1_700_000_000, 1_700_000_000))
    assert _ident(gguf) != base


def _hub_snapshot(cache, repo, commit, blobs):
    """A Hugging Face cache entry: snapshots/<commit>/<file> link to blobs/<content hash>."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    (root / "blobs").mkdir(exist_ok=True)
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, (blob, content) in blobs.items():
        (root / "blobs" / blob).write_bytes(content)
        link = snapshot / name
        if link.is_symlink():
            link.unlink()
        link.symlink_to(f"../../blobs/{blob}")
    return root


def test_hub_model_ids_use_the_cached_snapshot_and_its_blob_names(tmp_path):
    cache = tmp_path / "hub"
    weights = ("a" * 64, b"w" * 100)
    config = ("c" * 40, b'{"model_type": "llama"}')
    root = _hub_snapshot(cache, "org/model", "1" * 40, {"config.json": config, "model.safetensors": weights})

    def ident():
        cfg = vllm_config(model="org/model")
        cfg.load_config.download_dir = str(cache)
        return model_identity_document(cfg), model_identity(cfg)

    document, base = ident()
    assert document["files"]["weights"] == [["model.safetensors", 100, "blob:" + "a" * 64]]
    # Modification times do not matter for cached blobs (their name is their content hash)...
    os.utime(root / "blobs" / ("a" * 64), (1_900_000_000, 1_900_000_000))
    assert ident()[1] == base
    # ...but other content does, and so does a cache entry that is missing.
    _hub_snapshot(cache, "org/model", "1" * 40, {"model.safetensors": ("b" * 64, b"w" * 100)})
    assert ident()[1] != base
    other = vllm_config(model="org/absent")
    other.load_config.download_dir = str(cache)
    assert model_identity_document(other)["files"] is None


def test_namespace_without_model_identity_keeps_its_fingerprint():
    fields = dict(
        model="m", dtype="float32", kv_layout="cpu", block_size=32, num_layers=2, num_kv_heads=2, head_size=64
    )
    assert Namespace(**fields).key_component() == KNOWN_NAMESPACE
    assert Namespace(**fields, model_identity="").fingerprint() == Namespace(**fields).fingerprint()
    assert Namespace(**fields, model_identity="ab").key_component() != KNOWN_NAMESPACE


KNOWN_NAMESPACE = "1ce2ff7aeef39f81"  # computed with the code before the identity fields existed


def test_engine_namespace_folds_in_the_model_identity():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from connector.layout import engine_layout

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


def _namespace(cfg):
    return Namespace(
        model="m",
        dtype="float32",
        kv_layout="cpu",
        block_size=32,
        num_layers=2,
        num_kv_heads=2,
        head_size=64,
        model_identity=model_identity(cfg),
    )


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


def test_hybrid_layouts_name_their_groups_and_refuse_what_they_cannot_load_exactly():
    import pytest
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    from connector.groups import GroupKind
    from connector.layout import UnsupportedLayout, engine_layout

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

    from connector.layout import UnsupportedLayout, engine_layout

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

    from connector.layout import engine_layout

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

    from connector.layout import UnsupportedLayout, check_attention_layout

    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *args: "vec")
    layout = _layout(vllm_config())

    def engine(isa):
        backend = SimpleNamespace(get_name=lambda: "CPU_ATTN")
        layers = {name: SimpleNamespace(attn_backend=backend, isa=isa) for name in ("l0", "l1")}
        return SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=layers))

    check_attention_layout(engine("vec"), layout)
    with pytest.raises(UnsupportedLayout, match="amx"):
        check_attention_layout(engine("amx"), layout)
