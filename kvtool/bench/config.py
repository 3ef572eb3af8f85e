"""The bench's configuration: one validated object, built once from the command line."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvtool.pair.profiles import CONNECTOR_NAMES
from kvtool.errors import UserError
from kvtool.verify import DEFAULT_LOGPROB_TOLERANCE

from .workloads import TRACE_PREFIX, WORKLOADS, TraceReplay, Workload, with_options, workload_names

_Model = TypeVar("_Model", bound=BaseModel)

CONNECTORS: tuple[str, ...] = CONNECTOR_NAMES
DEFAULT_WORKLOADS = ("sub-block",)
TOP_LOGPROBS = 5


class BenchConfig(BaseModel):
    """Everything one bench run needs besides the pair it runs against."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workloads: tuple[str, ...] = DEFAULT_WORKLOADS
    requests: int = Field(default=8, gt=0, description="consumer requests per workload")
    max_tokens: int = Field(default=8, gt=0, description="tokens each consumer request generates")
    seed: int = 0
    verify: bool = True
    tolerance: float = Field(default=DEFAULT_LOGPROB_TOLERANCE, gt=0)
    # A workload's own flags (``Workload.Options``) by its name; a workload not named has its defaults.
    workload_options: dict[str, Any] = {}
    durability_timeout_s: float = Field(default=30.0, gt=0)
    request_timeout_s: float = Field(default=300.0, gt=0)
    # Seconds between the end of one request and the start of the next (a durability wait counts): on one
    # machine an engine's work after a request (0.5-1 s here) shares the cores with the next request's
    # HTTP handling, adding 20-200 ms to its TTFT, which engines on other hosts never see. The same for
    # every connector (benchmarks/compare-peers/README.md).
    quiet_s: float = Field(default=1.5, ge=0)
    # --compare with every pair up at once, each step sent to every pair in turn (kvtool/bench/interleave.py).
    interleave: bool = False

    def options_of(self, workload: type[Workload]) -> BaseModel | None:
        """``workload``'s own flags (its ``Options``, defaults where not given), or None without any."""
        if workload.Options is None:
            return None
        given = self.workload_options.get(workload.name)
        return given if given is not None else workload.Options()

    @classmethod
    def from_options(cls, **options: Any) -> BenchConfig:
        """The config for the CLI's flags (each workload's own flags grouped by workload); a UserError
        naming the first bad flag otherwise."""
        grouped = {}
        for workload in with_options():
            assert workload.Options is not None
            given = {name: options.pop(name) for name in workload.Options.model_fields if name in options}
            grouped[workload.name] = _checked("", partial(workload.Options, **given))
        return _checked("", lambda: cls(**options, workload_options=grouped))


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
        return TraceReplay.from_options(config.options_of(TraceReplay), path=path)
    if spec not in WORKLOADS:
        raise UserError(f"unknown workload {spec!r}; pick from: {', '.join(workload_names())}")
    return WORKLOADS[spec].from_options(config.options_of(WORKLOADS[spec]))
