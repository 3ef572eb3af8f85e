"""The bench's configuration: one validated object, built once from the command line."""

from __future__ import annotations

from pathlib import Path
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvtool.pair.profiles import CONNECTOR_NAMES
from kvtool.errors import UserError
from kvtool.verify import DEFAULT_LOGPROB_TOLERANCE

from .workloads import TRACE_PREFIX, WORKLOADS, TraceReplay, Workload, workload_names
from .workloads.prefix_repetition import PrefixRepetition

_Model = TypeVar("_Model", bound=BaseModel)

CONNECTORS: tuple[str, ...] = CONNECTOR_NAMES
DEFAULT_WORKLOADS = ("sub-block",)
TOP_LOGPROBS = 5


class TraceOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    block_tokens: int = Field(default=16, gt=0, description="tokens one 512-token trace block becomes")
    start: int = Field(default=0, ge=0, description="first trace line to replay (0-based)")
    requests: int | None = Field(default=None, gt=0, description="trace requests to replay [default: --requests]")


class PrefixRepetitionOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    prefix_len: int = Field(default=80, gt=0)
    suffix_len: int = Field(default=24, gt=0)
    num_prefixes: int = Field(default=2, gt=0)


class BenchConfig(BaseModel):
    """Everything one bench run needs besides the pair it runs against."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workloads: tuple[str, ...] = DEFAULT_WORKLOADS
    requests: int = Field(default=8, gt=0, description="consumer requests per workload")
    max_tokens: int = Field(default=8, gt=0, description="tokens each consumer request generates")
    seed: int = 0
    verify: bool = True
    tolerance: float = Field(default=DEFAULT_LOGPROB_TOLERANCE, gt=0)
    trace: TraceOptions = TraceOptions()
    prefix_repetition: PrefixRepetitionOptions = PrefixRepetitionOptions()
    durability_timeout_s: float = Field(default=30.0, gt=0)
    request_timeout_s: float = Field(default=300.0, gt=0)
    # Seconds between the end of one request and the start of the next (a durability wait counts): on one
    # machine an engine's work after a request (0.5-1 s here) shares the cores with the next request's
    # HTTP handling, adding 20-200 ms to its TTFT, which engines on other hosts never see. The same for
    # every connector (benchmarks/compare-peers/README.md).
    quiet_s: float = Field(default=1.5, ge=0)
    # --compare with every pair up at once, each step sent to every pair in turn (kvtool/bench/interleave.py).
    interleave: bool = False

    @classmethod
    def from_options(cls, **options: Any) -> BenchConfig:
        """The config for the CLI's flags (``trace_*`` and the prefix-repetition flags grouped); a
        UserError naming the first bad flag otherwise."""
        trace = {name: options.pop(f"trace_{name}") for name in ("block_tokens", "start", "requests")}
        repetition = {name: options.pop(name) for name in ("prefix_len", "suffix_len", "num_prefixes")}
        return _checked(
            "",
            lambda: cls(
                **options,
                trace=_checked("trace-", lambda: TraceOptions(**trace)),
                prefix_repetition=_checked("", lambda: PrefixRepetitionOptions(**repetition)),
            ),
        )


def _checked(prefix: str, build: Callable[[], _Model]) -> _Model:
    """``build()``, or a UserError naming its first bad field as the CLI flag ``--{prefix}{field}``."""
    try:
        return build()
    except ValidationError as exc:
        first = exc.errors()[0]
        raise UserError(f"--{prefix}{str(first['loc'][-1]).replace('_', '-')}: {first['msg']}") from None


def build_workload(spec: str, config: BenchConfig) -> Workload:
    """The workload a ``--workload`` value names; a UserError naming the accepted values otherwise."""
    if spec.startswith(TRACE_PREFIX):
        path = Path(spec[len(TRACE_PREFIX) :]).expanduser()
        if not path.is_file():
            raise UserError(f"trace file {path} does not exist or is not a file; give --workload trace:PATH")
        return TraceReplay(
            path=path, block_tokens=config.trace.block_tokens, start=config.trace.start, count=config.trace.requests
        )
    if spec == PrefixRepetition.name:
        return PrefixRepetition(**config.prefix_repetition.model_dump())
    if spec not in WORKLOADS:
        raise UserError(f"unknown workload {spec!r}; pick from: {', '.join(workload_names())}")
    return WORKLOADS[spec]()
