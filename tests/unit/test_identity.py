"""Identity gaps (issue 8): two engines or two requests whose KV differs for the same token ids never
share keys. Engine side: every input of the model identity moves the namespace. Request side:
prompt embeddings (and LoRA paths, multimodal positions) move the chain root; a plain text request
keeps the root it always had."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.core.modelidentity import model_identity, model_identity_document
from connector.core.keys import Namespace

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
    "dummy_weights": lambda c: setattr(c.load_config, "load_format", "dummy"),
    "mm_processor_kwargs": lambda c: setattr(c.model_config, "multimodal_config", _mm(mm_processor_kwargs={"fps": 1})),
    "media_io_kwargs": lambda c: setattr(c.model_config, "multimodal_config", _mm(media_io_kwargs={"video": {"n": 8}})),
    "video_pruning_rate": lambda c: setattr(c.model_config, "multimodal_config", _mm(video_pruning_rate=0.5)),
}


def _mm(**fields):
    defaults = dict(mm_processor_kwargs=None, media_io_kwargs={}, video_pruning_rate=None, mm_processor_cache_gb=4)
    return SimpleNamespace(**{**defaults, **fields})


def test_settings_added_later_leave_every_other_engine_its_namespace():
    """The load format and the engine's multimodal settings enter the identity only where set."""
    base = vllm_config()
    default_mm, auto = vllm_config(), vllm_config()
    default_mm.model_config.multimodal_config = _mm()
    auto.load_config.load_format = "auto"
    assert model_identity(default_mm) == model_identity(auto) == model_identity(base)


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
    "mm_processor_kwargs": "multimodal_config",
    "media_io_kwargs": "multimodal_config",
    "video_pruning_rate": "multimodal_config",
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


def test_a_config_read_from_elsewhere_is_in_the_identity_by_its_files(tmp_path):
    """``--hf-config-path``: its config files enter the identity (another norm epsilon there changes KV
    for the same tokens), not the loaded config, which model constructors change in the worker's process."""

    def build(eps, where):
        where.mkdir(exist_ok=True)
        (where / "config.json").write_text(f'{{"rms_norm_eps": {eps}}}')
        return model_identity(vllm_config(hf_config_path=str(where)))

    assert build(1e-5, tmp_path / "a") != build(1e-6, tmp_path / "b")
    assert build(1e-5, tmp_path / "a") == build(1e-5, tmp_path / "c")  # where it lies: not KV
    base = vllm_config()
    loaded = vllm_config(hf=hf_config(rms_norm_eps=1e-5, num_ln_in_parallel_attn=2))  # set by a constructor
    assert model_identity(base) == model_identity(loaded)  # the loaded config's other fields never enter


def _scale_by(factor):
    def override(config):
        config.rms_norm_eps = factor
        return config

    return override


def test_an_hf_overrides_function_is_in_the_identity_by_its_code():
    """Two functions of one name (lambdas, one factory's closures) that change the config differently
    gave one identity; their code and closure values enter now."""
    eps_5, eps_6 = _scale_by(1e-5), _scale_by(1e-6)
    other = lambda config: config  # noqa: E731
    ids = {model_identity(vllm_config(hf_overrides=f)) for f in (eps_5, eps_6, other, _override_fn)}
    assert len(ids) == 4
    assert model_identity(vllm_config(hf_overrides=_scale_by(1e-5))) == model_identity(vllm_config(hf_overrides=eps_5))


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


def test_the_vllm_version_is_part_of_the_model_identity(monkeypatch):
    import vllm

    cfg = vllm_config()
    document = model_identity_document(cfg)
    assert document["vllm"] == vllm.__version__
    before = model_identity(cfg)
    monkeypatch.setattr(vllm, "__version__", vllm.__version__ + ".post1")
    assert model_identity(cfg) != before
