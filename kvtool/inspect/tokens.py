"""The prompt ``kvtool inspect prompt`` is asked about: token ids, or text tokenized as vLLM does."""

from __future__ import annotations

import json
from pathlib import Path

from connector.core.hashing import MAX_TOKEN_ID  # what the key schema encodes
from kvtool.errors import UserError


def parse_token_ids(text: str, what: str = "the prompt") -> list[int] | None:
    """Token ids written as a JSON list or separated by commas/whitespace; None if ``text`` is not that
    (text such as ``[INST] ...`` that is no JSON). A JSON list that is not token ids is a UserError."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            values = json.loads(stripped)
        except json.JSONDecodeError:
            return None
        ids = isinstance(values, list) and values and all(_is_token_id(v) for v in values)
        if not ids:
            raise UserError(
                f"{what} is a JSON list but not of token ids (whole numbers 0..{MAX_TOKEN_ID}): {stripped[:60]}"
            )
        return values
    parts = stripped.replace(",", " ").split()
    if not parts or not all(p.isdigit() for p in parts):
        return None
    ids = [int(p) for p in parts]
    if max(ids) > MAX_TOKEN_ID:
        raise UserError(f"{what} has token id {max(ids)}, above {MAX_TOKEN_ID}; token ids are 0..{MAX_TOKEN_ID}")
    return ids


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID


def prompt_tokens(tokens: str | None, text: str | None, file: Path | None, model: str | None) -> list[int]:
    """The prompt from exactly one of --tokens, --text or --file (token ids, or else text)."""
    given = [name for name, value in (("--tokens", tokens), ("--text", text), ("--file", file)) if value is not None]
    if len(given) != 1:
        raise UserError("give the prompt as exactly one of --tokens 1,2,3, --text STR or --file F")
    if tokens is not None:
        ids = parse_token_ids(tokens, f"--tokens {tokens[:40]!r}")
        if not ids:
            raise UserError(f"--tokens {tokens!r} is not a comma-separated list of token ids")
        return ids
    if file is not None:
        try:
            content = Path(file).read_text(encoding="utf-8")
        except OSError as exc:
            raise UserError(f"cannot read --file {file}: {exc}") from None
        except UnicodeDecodeError:
            raise UserError(f"--file {file} is not UTF-8 text; give token ids or text") from None
        if not content.strip():
            raise UserError(f"--file {file} is empty; give token ids or text")
        ids = parse_token_ids(content, f"--file {file}")
        if ids:
            return ids
        text = content
    return tokenize(text or "", model)


def tokenize(text: str, model: str | None) -> list[int]:
    """Token ids as vLLM's /v1/completions makes them from a text prompt (special tokens added)."""
    if not model:
        raise UserError("--text needs the served model's tokenizer: give --model DIR or --pair READY_FILE")
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    except Exception as exc:  # transformers raises assorted errors for a missing or bad tokenizer
        raise UserError(f"cannot load the tokenizer of {model}: {exc}") from None
    return list(tokenizer(text)["input_ids"])
