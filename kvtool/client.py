"""A small client for the vLLM OpenAI server's /v1/completions with token-id prompts."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from kvtool import web
from kvtool.errors import ServerError

DEFAULT_TIMEOUT_S = 120.0


def completion_body(
    model: str,
    prompt_token_ids: list[int],
    max_tokens: int,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    stream: bool = False,
    kv_transfer_params: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt_token_ids),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if logprobs is not None:
        body["logprobs"] = logprobs
    if prompt_logprobs is not None:
        # vLLM skips the prefix cache (and any connector hit) for such a request: a full recompute.
        body["prompt_logprobs"] = prompt_logprobs
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra or {})
    return body


def complete(
    base_url: str,
    model: str,
    prompt_token_ids: list[int],
    max_tokens: int,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    stream: bool = False,
    kv_transfer_params: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict[str, Any]:
    """POST a completion and return the response JSON.

    The result also carries ``kvtool_timing`` = {"ttft_s", "total_s"} measured here. With
    stream=True the chunks are merged into one response-shaped dict (text and logprobs of choice 0
    concatenated, the last ``usage`` and ``kv_transfer_params`` seen kept) plus ``chunks``.
    """
    body = completion_body(
        model, prompt_token_ids, max_tokens, logprobs, prompt_logprobs, stream, kv_transfer_params, extra
    )
    url = base_url.rstrip("/") + "/v1/completions"
    started = time.perf_counter()
    try:
        if not stream:
            response = web.post(url, json=body, timeout=timeout_s)
            _raise_for_status(url, response)
            result = response.json()
            elapsed = time.perf_counter() - started
            result["kvtool_timing"] = {"ttft_s": elapsed, "total_s": elapsed}
            return result
        with web.stream("POST", url, json=body, timeout=timeout_s) as response:
            if response.status_code != 200:
                response.read()
                _raise_for_status(url, response)
            return _merge_stream(response, started)
    except httpx.HTTPError as exc:
        raise ServerError(f"request to {url} failed: {exc}") from None


def _raise_for_status(url: str, response: httpx.Response) -> None:
    if response.status_code == 200:
        return
    try:
        message = response.json().get("error", {}).get("message") or response.text
    except ValueError:
        message = response.text
    raise ServerError(f"{url} answered HTTP {response.status_code}: {message.strip()[:300]}")


def _merge_stream(response: httpx.Response, started: float) -> dict[str, Any]:
    chunks: list[dict[str, Any]] = []
    ttft: float | None = None
    text: list[str] = []
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[Any] = []
    merged: dict[str, Any] = {}
    finish_reason = None
    token_chunk_s: list[float] = []  # when each chunk that carried tokens arrived (for the ITL)
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        chunks.append(chunk)
        for key in ("id", "model", "usage", "kv_transfer_params"):
            if chunk.get(key) is not None:
                merged[key] = chunk[key]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            # The first token, even one whose text is empty (a byte of an unfinished character).
            if choice.get("text") or (choice.get("logprobs") or {}).get("tokens") or choice.get("token_ids"):
                token_chunk_s.append(time.perf_counter() - started)
                ttft = token_chunk_s[0]
            text.append(choice.get("text") or "")
            finish_reason = choice.get("finish_reason") or finish_reason
            if choice.get("logprobs"):
                tokens += choice["logprobs"].get("tokens") or []
                token_logprobs += choice["logprobs"].get("token_logprobs") or []
                top_logprobs += choice["logprobs"].get("top_logprobs") or []
    total = time.perf_counter() - started
    choice0: dict[str, Any] = {"index": 0, "text": "".join(text), "finish_reason": finish_reason}
    if tokens:
        choice0["logprobs"] = {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
        }
    merged["choices"] = [choice0]
    merged["chunks"] = chunks
    merged["kvtool_timing"] = {
        "ttft_s": ttft if ttft is not None else total,
        "total_s": total,
        "token_chunk_s": token_chunk_s,
    }
    return merged


def wait_healthy(base_url: str, timeout_s: float = 300.0, poll_s: float = 0.5) -> None:
    """Wait for GET /health to answer 200; raise ServerError after timeout_s."""
    url = base_url.rstrip("/") + "/health"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if web.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise ServerError(f"{url} did not answer 200 within {timeout_s:.0f} s")
        time.sleep(poll_s)
