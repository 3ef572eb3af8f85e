"""The generated model presets: names, files, markers (no vLLM)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtool.errors import UserError
from kvtool.model import (
    GEMMA3,
    GRANITE_HYBRID,
    LLAMA,
    MARKER_FILE,
    PRESETS,
    _marker_content,
    default_model_dir,
    ensure_default_model,
    is_generated_model,
)

# The marker of the tiny preset as MODEL_FORMAT_VERSION 1 wrote it: cached copies carry exactly this.
TINY_MARKER = {
    "version": 1,
    "seed": 1234,
    "preset": {
        "name": "tiny",
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 1024,
        "max_position_embeddings": 2048,
    },
}
TINY_MARKER_TEXT = json.dumps(TINY_MARKER, indent=2) + "\n"


def test_presets_listed() -> None:
    assert list(PRESETS) == ["tiny", "bench", "long", "swa", "mamba"]
    assert {name: spec.architecture for name, spec in PRESETS.items()} == {
        "tiny": LLAMA,
        "bench": LLAMA,
        "long": LLAMA,
        "swa": GEMMA3,
        "mamba": GRANITE_HYBRID,
    }
    assert all(spec.name == name for name, spec in PRESETS.items())


def test_default_directories(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVTOOL_HOME", str(tmp_path))
    names = {preset: default_model_dir(preset).name for preset in PRESETS}
    assert names == {
        "tiny": "tiny-llama",
        "bench": "bench-llama",
        "long": "long-llama",
        "swa": "swa-gemma3",
        "mamba": "mamba-granitehybrid",
    }
    assert default_model_dir("swa").parent == tmp_path / "models"


def test_llama_markers_unchanged() -> None:
    assert _marker_content(PRESETS["tiny"]) == TINY_MARKER
    assert json.dumps(_marker_content(PRESETS["tiny"]), indent=2) + "\n" == TINY_MARKER_TEXT
    bench = _marker_content(PRESETS["bench"])["preset"]
    assert set(bench) == set(TINY_MARKER["preset"])  # no added field leaks into the Llama markers


def test_tiny_copy_written_before_presets_grew_is_still_current(tmp_path: Path) -> None:
    (tmp_path / MARKER_FILE).write_text(TINY_MARKER_TEXT)
    assert is_generated_model(tmp_path, PRESETS["tiny"])
    assert not is_generated_model(tmp_path, PRESETS["swa"])


def test_new_markers_name_architecture_but_not_engine_flags() -> None:
    swa = _marker_content(PRESETS["swa"])["preset"]
    assert swa["architecture"] == GEMMA3
    assert dict(swa["hf_config"])["layer_types"] == ["sliding_attention", "full_attention"] * 2
    mamba = _marker_content(PRESETS["mamba"])["preset"]
    assert mamba["architecture"] == GRANITE_HYBRID
    assert "engine_args" not in mamba  # serving flags do not shape the files: changing them regenerates nothing
    # What json reads back equals the content, so a fresh marker is recognised.
    assert json.loads(json.dumps(_marker_content(PRESETS["mamba"]))) == _marker_content(PRESETS["mamba"])


def test_serving_data() -> None:
    assert PRESETS["tiny"].engine_args == ()
    assert PRESETS["swa"].engine_args == ()
    args = PRESETS["mamba"].engine_args
    assert args[args.index("--mamba-cache-mode") + 1] == "align"
    assert args[args.index("--max-num-batched-tokens") + 1] == "64"
    assert {name: spec.kv_block_size for name, spec in PRESETS.items()} == {
        "tiny": 32,
        "bench": 32,
        "long": 32,
        "swa": 32,
        "mamba": 64,
    }
    # float32: a Mamba layer's state is 3*(256+2*16)*4 + 8*32*16*4 bytes; one 32-token attention page is
    # 2*2*32*4*32 = 16,384 bytes, so vLLM doubles the block.
    assert PRESETS["mamba"].mamba_state_bytes() == 19840
    assert PRESETS["mamba"].kv_block_size_for(64) == 64
    assert PRESETS["mamba"].kv_block_size_for(128) == 128
    assert PRESETS["swa"].kv_block_size_for(64) == 64
    assert PRESETS["swa"].sliding_window == 64
    assert PRESETS["mamba"].is_hybrid and not PRESETS["swa"].is_hybrid


def test_unknown_preset_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="swa"):
        ensure_default_model(tmp_path / "x", preset="huge")


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny, swa and mamba presets, generated once for this module (a few seconds, mostly imports)."""
    root = tmp_path_factory.mktemp("models")
    return {preset: ensure_default_model(root / preset, preset=preset) for preset in ("tiny", "swa", "mamba")}


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_swa_files(generated: dict[str, Path]) -> None:
    config = _config(generated["swa"])
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["model_type"] == "gemma3_text"
    assert config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    assert config["sliding_window"] == 64
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (128, 4, 32)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["query_pre_attn_scalar"] == 32
    assert is_generated_model(generated["swa"], PRESETS["swa"])


def test_mamba_files(generated: dict[str, Path]) -> None:
    config = _config(generated["mamba"])
    assert config["architectures"] == ["GraniteMoeHybridForCausalLM"]
    assert config["model_type"] == "granitemoehybrid"
    assert config["layer_types"] == ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    assert config["num_local_experts"] == 0 and config["shared_intermediate_size"] == 256
    assert config["mamba_n_heads"] * config["mamba_d_head"] == config["mamba_expand"] * config["hidden_size"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (128, 4, 2)
    assert is_generated_model(generated["mamba"], PRESETS["mamba"])


def test_all_presets_share_one_tokenizer(generated: dict[str, Path]) -> None:
    tokenizers = {preset: (path / "tokenizer.json").read_bytes() for preset, path in generated.items()}
    assert tokenizers["swa"] == tokenizers["tiny"] == tokenizers["mamba"]
    for path in generated.values():
        config = _config(path)
        assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (1024, 1, 2)


def test_generation_is_deterministic(generated: dict[str, Path], tmp_path: Path) -> None:
    again = ensure_default_model(tmp_path / "mamba", preset="mamba")
    for name in ("model.safetensors", "config.json", "tokenizer.json", MARKER_FILE):
        assert (again / name).read_bytes() == (generated["mamba"] / name).read_bytes(), name


def test_current_copy_is_kept(generated: dict[str, Path]) -> None:
    weights = generated["swa"] / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert ensure_default_model(generated["swa"], preset="swa") == generated["swa"]
    assert weights.stat().st_mtime_ns == before


def test_the_cost_model_judges_hits_on_the_bench_models_and_a_real_one(tmp_path, monkeypatch):
    """Off (every hit taken) on the test presets, whose prefill costs microseconds a token; on for the
    bench and long presets (about a millisecond a token) and for --model; the flag overrides either."""
    from kvtool.commands.pairoptions import PairOptions
    from kvtool.pair.engines import engine_argv

    monkeypatch.setattr("kvtool.model.ensure_default_model", lambda preset: tmp_path / preset)

    def takes_every_hit(**options) -> bool:
        cfg = PairOptions(log_dir=tmp_path, **options).config(report=lambda _: None)
        argv = engine_argv(cfg, "consumer")
        extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
        assert extra.get("skip_unprofitable_loads", True) is not cfg.take_every_hit
        return cfg.take_every_hit

    assert all(takes_every_hit(model_preset=preset) for preset in ("tiny", "swa", "mamba"))
    assert not any(takes_every_hit(model_preset=preset) for preset in ("bench", "long"))
    assert not takes_every_hit(model=tmp_path)
    assert takes_every_hit(model_preset="bench", take_every_hit=True)
    assert not takes_every_hit(model_preset="tiny", take_every_hit=False)
