"""Local random-weight Llama models, so that nothing needs a model hub.

Weights and tokenizer are deterministic: the same preset gives the same files on every machine,
which keeps token ids and logprobs in tests reproducible.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtool.errors import UserError

# Bump when the generated files change, so cached copies are rebuilt.
MODEL_FORMAT_VERSION = 1
MARKER_FILE = ".kvtool-model.json"
SEED = 1234

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: Llama's unk/bos/eos defaults


@dataclass(frozen=True)
class ModelPreset:
    name: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # the CPU attention backend takes 32, 64, 80, 96, 112, 128, ...
    vocab_size: int
    max_position_embeddings: int = 2048


PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset("tiny", 2, 128, 256, 4, 2, 64, 1024),
    # Large enough that prefill time on the CPU is visible in TTFT benchmarks.
    "bench": ModelPreset("bench", 12, 768, 2048, 12, 4, 64, 1024),
}


def kvtool_home() -> Path:
    return Path(os.environ.get("KVTOOL_HOME") or Path.home() / ".cache" / "kvtool").expanduser()


def default_model_dir(preset: str = "tiny") -> Path:
    return kvtool_home() / "models" / f"{preset}-llama"


def _marker_content(preset: ModelPreset) -> dict:
    return {"version": MODEL_FORMAT_VERSION, "seed": SEED, "preset": asdict(preset)}


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


def _write_model(directory: Path, spec: ModelPreset) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    tokenizer = _train_tokenizer(spec)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    (directory / MARKER_FILE).write_text(json.dumps(_marker_content(spec), indent=2) + "\n")
