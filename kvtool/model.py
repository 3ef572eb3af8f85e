"""Local random-weight models (Llama, Gemma3 sliding window, Granite Mamba2 hybrid), so that nothing needs a model hub.

Weights and tokenizer are deterministic: the same preset gives the same files on every machine,
which keeps token ids and logprobs in tests reproducible. Every preset shares one tokenizer (same vocab).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from kvtool.errors import UserError

# Bump when the generated files change, so cached copies are rebuilt.
MODEL_FORMAT_VERSION = 1
MARKER_FILE = ".kvtool-model.json"
SEED = 1234

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: Llama's unk/bos/eos defaults

LLAMA = "LlamaForCausalLM"
GEMMA3 = "Gemma3ForCausalLM"
GRANITE_HYBRID = "GraniteMoeHybridForCausalLM"
# The directory name's suffix for each architecture: <preset>-<suffix>.
_ARCH_SUFFIX = {LLAMA: "llama", GEMMA3: "gemma3", GRANITE_HYBRID: "granitehybrid"}

DEFAULT_BLOCK_SIZE = 32  # vLLM's --block-size that serve-pair passes by default


@dataclass(frozen=True)
class ModelPreset:
    """One generated model: what shapes its files, and what vLLM needs to serve it.

    Fields after ``max_position_embeddings`` were added later; they stay out of the marker file while they
    hold their default, so the markers (and cached copies) of the Llama presets are unchanged.
    """

    name: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # the CPU attention backend takes 32, 64, 80, 96, 112, 128, ...
    vocab_size: int
    max_position_embeddings: int = 2048
    # The HF ``architectures`` entry, which picks the config/model classes: LLAMA, GEMMA3 or GRANITE_HYBRID.
    architecture: str = LLAMA
    # Extra keyword arguments of the architecture's HF config (sorted (key, value) pairs; lists as tuples),
    # e.g. layer_types, sliding_window, the mamba_* sizes.
    hf_config: tuple[tuple[str, Any], ...] = ()
    # Extra vLLM engine flags the model needs (serve-pair appends them to every engine's command line).
    # Not part of the generated files, so not in the marker.
    engine_args: tuple[str, ...] = ()
    # Whether serve-pair and bench --launch turn the kvtool connector's cost model off on this preset
    # (``--take-every-hit``): on the test models prefill costs microseconds a token, so the model would
    # decline most sub-block hits, and those models are there to show reuse. Not in the marker either.
    takes_every_hit: bool = True

    def engine_args_for(self, requested_block_size: int = DEFAULT_BLOCK_SIZE, saves: bool = False) -> tuple[str, ...]:
        """Every flag an engine of this preset gets; ``saves``: the engine publishes KV (a producer).

        On a Mamba hybrid, vLLM keeps (and offers a connector) a state only at the boundaries it
        retains: ``--prefix-cache-retention-interval <block>`` retains one at every block boundary, so a
        prompt sharing only the first blocks of a stored one still hits.

        An engine that saves also gets ``--prefix-match-unit 1``: its prefill then ends a step one token
        short of the prompt, and vLLM offers that state (a copy-on-write copy of the block, in the step
        that completes the prompt), which the same prompt sent on unchanged needs (a hit of ``L - 1``).
        The state after the whole prompt stays in the block of its last token. The sub-block local hits
        this also turns on are copied only partly by vLLM 0.32 on a hybrid model; the connector's worker
        completes those copies (connector.worker.worker.WorkerSide.repair_block_copies)."""
        if not self.is_hybrid:
            return self.engine_args
        every_block = str(self.kv_block_size_for(requested_block_size))
        flags = self.engine_args + ("--prefix-cache-retention-interval", every_block)
        return flags + ("--prefix-match-unit", "1") if saves else flags

    @property
    def config_overrides(self) -> dict[str, Any]:
        """``hf_config`` as keyword arguments (tuples back to lists)."""
        return {key: list(value) if isinstance(value, tuple) else value for key, value in self.hf_config}

    @property
    def layer_types(self) -> tuple[str, ...]:
        """Each layer's kind as the HF config names it ("full_attention", "sliding_attention", "linear_attention")."""
        return tuple(self.config_overrides.get("layer_types", ["full_attention"] * self.num_hidden_layers))

    @property
    def is_hybrid(self) -> bool:
        """Mamba layers next to attention layers: vLLM aligns the attention block size to the Mamba state."""
        return "linear_attention" in self.layer_types

    @property
    def dir_name(self) -> str:
        """The default directory name under $KVTOOL_HOME/models: tiny-llama, swa-gemma3, mamba-granitehybrid."""
        return f"{self.name}-{_ARCH_SUFFIX[self.architecture]}"

    def mamba_state_bytes(self, dtype_bytes: int = 4) -> int:
        """One Mamba2 layer's state in vLLM's cache (conv state + SSM state), in bytes; 0 without Mamba layers."""
        if not self.is_hybrid:
            return 0
        cfg = self.config_overrides
        inner = cfg["mamba_expand"] * self.hidden_size
        conv = (cfg["mamba_d_conv"] - 1) * (inner + 2 * cfg["mamba_n_groups"] * cfg["mamba_d_state"])
        ssm = cfg["mamba_n_heads"] * cfg["mamba_d_head"] * cfg["mamba_d_state"]
        return (conv + ssm) * dtype_bytes

    def kv_block_size_for(self, requested: int = DEFAULT_BLOCK_SIZE, dtype_bytes: int = 4) -> int:
        """The KV block size (tokens) the engine ends up using when given ``--block-size requested``.

        For a hybrid model vLLM raises the attention block size (in multiples of ``requested``) until one
        attention page (all K and V of a block, one layer) holds a Mamba layer's state, and pads the Mamba
        page to that size; ``align`` mode then caches Mamba states at those block boundaries. Other models
        keep ``requested``. ``dtype_bytes`` is the KV dtype's size (4 for float32).
        """
        state = self.mamba_state_bytes(dtype_bytes)
        if not state:
            return requested
        attn_token = 2 * self.num_key_value_heads * self.head_dim * dtype_bytes
        return requested * max(1, math.ceil(state / (requested * attn_token)))

    @property
    def kv_block_size(self) -> int:
        """The engine's KV block size with serve-pair's default --block-size 32 and float32."""
        return self.kv_block_size_for(DEFAULT_BLOCK_SIZE)

    @property
    def sliding_window(self) -> int | None:
        """The sliding window (tokens) of the sliding attention layers, or None."""
        return self.config_overrides.get("sliding_window")


# Fields that do not shape the generated files: never in the marker.
_SERVE_ONLY_FIELDS = frozenset({"engine_args", "takes_every_hit"})
# Fields added after the first presets: in the marker only when they differ from their default.
_LATER_FIELDS = frozenset({"architecture", "hf_config"})


def _freeze(**kwargs: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((key, tuple(value) if isinstance(value, list) else value) for key, value in kwargs.items()))


PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset("tiny", 2, 128, 256, 4, 2, 64, 1024),
    # Large enough that prefill time on the CPU is visible in TTFT benchmarks (about 1 ms a token here), so
    # the cost model judges its hits as it would a real model's: a load that saves a token or two is declined.
    "bench": ModelPreset("bench", 12, 768, 2048, 12, 4, 64, 1024, takes_every_hit=False),
    # The bench model's shapes with 16k positions: long prompts (benchmarks/fast-path/stream_gap.py saves
    # 8k-token ones while a stream decodes).
    "long": ModelPreset("long", 12, 768, 2048, 12, 4, 64, 1024, max_position_embeddings=16384, takes_every_hit=False),
    # Gemma3 text model, sliding window and full attention layers alternating: vLLM makes two KV cache
    # groups (full, sliding window 64), both with the requested block size.
    "swa": ModelPreset(
        "swa",
        4,
        128,
        256,
        4,
        2,
        32,
        1024,
        architecture=GEMMA3,
        hf_config=_freeze(
            layer_types=["sliding_attention", "full_attention"] * 2,
            sliding_window=64,
            sliding_window_pattern=2,  # the older name of the same alternation, for readers that use it
            query_pre_attn_scalar=32,
        ),
    ),
    # Granite 4.0-style hybrid: Mamba2 and attention layers alternating, dense MLP (no experts), RoPE.
    # vLLM makes an attention group and a Mamba group; one Mamba state (19,840 B in float32) outgrows a
    # 32-token attention page (16,384 B), so the engine's block size becomes 64 with --block-size 32.
    "mamba": ModelPreset(
        "mamba",
        4,
        128,
        256,
        4,
        2,
        32,  # GraniteMoeHybrid's attention head size is hidden_size / num_attention_heads
        1024,
        architecture=GRANITE_HYBRID,
        hf_config=_freeze(
            layer_types=["linear_attention", "full_attention"] * 2,
            num_local_experts=0,
            shared_intermediate_size=256,
            position_embedding_type="rope",
            mamba_n_heads=8,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=64,
        ),
        # "align": prefix caching of Mamba state (vLLM keeps the state where a scheduler step ends on a block
        # boundary). A step budget of one engine block (64 tokens): the setup verified on vLLM 0.32's CPU build.
        engine_args=("--mamba-cache-mode", "align", "--max-num-batched-tokens", "64"),
    ),
}


def model_vocab_size(model: Path) -> int:
    """The vocabulary size a model directory's ``config.json`` gives (what token ids a workload may use)."""
    try:
        return int(json.loads((model / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"cannot read vocab_size from {model / 'config.json'}: {exc}") from None


def kvtool_home() -> Path:
    return Path(os.environ.get("KVTOOL_HOME") or Path.home() / ".cache" / "kvtool").expanduser()


def default_model_dir(preset: str = "tiny") -> Path:
    spec = PRESETS.get(preset)
    return kvtool_home() / "models" / (spec.dir_name if spec is not None else f"{preset}-llama")


def _marker_content(preset: ModelPreset) -> dict:
    """What the marker file holds, as JSON reads it back (lists, not tuples)."""
    described = asdict(preset)
    for spec_field in fields(ModelPreset):
        if spec_field.name in _SERVE_ONLY_FIELDS or (
            spec_field.name in _LATER_FIELDS and described[spec_field.name] == spec_field.default
        ):
            del described[spec_field.name]
    content = {"version": MODEL_FORMAT_VERSION, "seed": SEED, "preset": described}
    return json.loads(json.dumps(content))


def is_generated_model(path: Path, preset: ModelPreset) -> bool:
    try:
        return json.loads((path / MARKER_FILE).read_text()) == _marker_content(preset)
    except (OSError, ValueError):
        return False


def ensure_default_model(cache_dir: Path | None = None, preset: str = "tiny") -> Path:
    """Return the directory of the preset's model, generating it the first time."""
    if preset not in PRESETS:
        raise UserError(f"unknown model size {preset!r}; pick one of: {', '.join(PRESETS)}")
    spec = PRESETS[preset]
    target = Path(cache_dir) if cache_dir is not None else default_model_dir(preset)
    if is_generated_model(target, spec):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_model(staging, spec)
        staging.chmod(0o755)  # mkdtemp makes it private; the model is shared, read-only data
        for file in staging.iterdir():
            file.chmod(0o644)
        if target.exists():
            # A stale or foreign-version copy: replace it; a concurrent writer may have won meanwhile.
            if is_generated_model(target, spec):
                return target
            shutil.rmtree(target)
        try:
            os.rename(staging, target)
        except OSError:
            if is_generated_model(target, spec):
                return target
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def training_sentences(count: int = 600, seed: int = SEED) -> list[str]:
    """Pseudo-English sentences built from a fixed syllable inventory."""
    rng = random.Random(seed)
    onsets = ["b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "tr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
    codas = ["", "", "n", "r", "s", "t", "l", "nd", "ck"]
    words = sorted(
        {
            "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 3)))
            for _ in range(400)
        }
    )
    sentences = []
    for _ in range(count):
        picked = [rng.choice(words) for _ in range(rng.randint(5, 16))]
        if rng.random() < 0.3:
            picked.insert(rng.randrange(len(picked)), str(rng.randint(0, 9999)))
        sentence = " ".join(picked).capitalize() + rng.choice([".", ".", "?", "!", ","])
        sentences.append(sentence)
    return sentences


def _train_tokenizer(spec: ModelPreset):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_sentences(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token=SPECIAL_TOKENS[0],
        bos_token=SPECIAL_TOKENS[1],
        eos_token=SPECIAL_TOKENS[2],
        model_max_length=spec.max_position_embeddings,
    )


def _hf_classes(architecture: str) -> tuple[type, type]:
    """The (config class, model class) pair of an architecture."""
    if architecture == LLAMA:
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaConfig, LlamaForCausalLM
    if architecture == GEMMA3:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        return Gemma3TextConfig, Gemma3ForCausalLM
    if architecture == GRANITE_HYBRID:
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        return GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
    raise ValueError(f"no generator for architecture {architecture!r}")


def _hf_config(spec: ModelPreset, tokenizer) -> Any:
    config_cls, _ = _hf_classes(spec.architecture)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="float32",
    )
    if spec.architecture == LLAMA:
        common.update(head_dim=spec.head_dim, tie_word_embeddings=False)
    elif spec.architecture == GEMMA3:
        # Gemma3 ties the output layer to the embedding (its default; vLLM honours the flag).
        common.update(head_dim=spec.head_dim, tie_word_embeddings=True, pad_token_id=None)
    else:
        # GraniteMoeHybrid has no head_dim: the attention head size is hidden_size / num_attention_heads.
        if spec.hidden_size // spec.num_attention_heads != spec.head_dim:
            raise ValueError(f"preset {spec.name}: head_dim must be hidden_size / num_attention_heads")
        common.update(tie_word_embeddings=False)
    common.update(spec.config_overrides)
    config = config_cls(**common)
    config.architectures = [spec.architecture]
    return config


def _write_model(directory: Path, spec: ModelPreset) -> None:
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    tokenizer = _train_tokenizer(spec)
    config = _hf_config(spec, tokenizer)
    _, model_cls = _hf_classes(spec.architecture)
    torch.manual_seed(SEED)
    model = model_cls(config).to(torch.float32).eval()
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    (directory / MARKER_FILE).write_text(json.dumps(_marker_content(spec), indent=2) + "\n")
