"""`kvtool bench --load agentic|chat`: a load test, sessions in flight, on a running pair or fleet
(``--pair``), or on each connector's launched in turn (``--launch [--compare ...]``), with every figure
side by side in one report (``kvtool.load.report``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvtool.commands.output import OutputOptions
from kvtool.commands.pairoptions import PairOptions
from kvtool.bench.workloads.trace import read_trace
from kvtool.errors import UserError
from kvtool.pair.config import ServePairConfig
from kvtool.portable import portable
from kvtool.pair.profiles import profile
from kvtool.pair.ready import ReadyFile, read_ready_file
from kvtool.pair.router import RouterWorkers

from .churn import RotationWatch, phase_summaries, victim
from .join import JoinWatch, fleet_to_grow, join_phases
from .metrics import summarize
from .options import LoadOptions, LoadResult
from .runner import LoadRunner, LoadTarget
from .sessions import LoadShape, TraceLoad, plan_sessions


def load_command(
    options: LoadOptions,
    output: OutputOptions,
    pair_options: PairOptions,
    ready_file: Path | None,
    launch: bool,
    compared: list[str] | None,
    plot: Path | None = None,
    trace_start: int = 0,
    trace_block_tokens: int = 16,
    **bench: Any,
) -> None:
    """``kvtool bench --load``: check every input, run, print the report and write the plot (``bench``:
    bench's ``max_tokens``, ``seed`` and ``tolerance``; ``trace_*``: its trace flags, for trace:PATH)."""
    from kvtool.bench.command import provenance
    from kvtool.commands.output import emit

    from .report import load_report

    options.check()
    trace = options.trace_load(trace_start, trace_block_tokens)
    if trace is not None:
        read_trace(trace.path, trace.start, 1)  # a trace that cannot be read is said before any pair starts
    if options.kill_engine_after is not None and not launch and ready_file is not None:
        victim(read_ready_file(ready_file))  # a pair, or a fleet of one: said before any load
    if options.add_engine_after is not None and not launch and ready_file is not None:
        fleet_to_grow(read_ready_file(ready_file))  # a pair: said before any load
    if (ready_file is None) == (not launch):
        raise UserError("--load needs one pair: give --pair READY_FILE or --launch (not both)")
    if compared and not launch:
        raise UserError("--compare starts each connector's pair or fleet in turn: it needs --launch")
    if plot is not None and options.sweep_rates is None:
        raise UserError("--plot with --load draws a sweep: give --sweep-rates too (or leave --plot out)")
    launch_cfg = pair_options.config(report=output.say) if launch else None
    if options.kill_engine_after is not None and launch_cfg is not None and launch_cfg.engines < 2:
        raise UserError("--kill-engine-after needs a fleet of 2 engines or more: give --engines N with --launch")
    if options.add_engine_after is not None and launch_cfg is not None and not launch_cfg.is_fleet:
        raise UserError("--add-engine-after needs a fleet: give --engines N with --launch")
    measured = provenance()  # the commit and the cores, when the run starts
    results = run_load(
        options, say=output.say, ready_file=ready_file, launch_cfg=launch_cfg, compared=compared, trace=trace, **bench
    )
    traced = {"trace": {"start": trace.start, "block_tokens": trace.block_tokens}} if trace is not None else {}
    load = portable(options.__dict__)
    config = {**measured, "load": load, **traced, **bench, "pair": _portable(launch_cfg) if launch_cfg else None}
    emit(load_report(results, options, config), output)
    if plot is not None:
        from .plot import write_sweep_plot

        write_sweep_plot(plot, results, options)
        output.say(f"wrote {plot}")
    failed = sum(result.summary.failed for result in results)
    differed = sum(result.run.checked.get("differed", 0) for result in results)
    if failed or differed:
        raise UserError(
            f"{failed} request(s) failed and {differed} answer(s) differed from a recomputation", exit_code=1
        )


def _portable(cfg: ServePairConfig) -> dict[str, Any]:
    """The launch configuration as a result file keeps it: no path of this machine (the model by its
    directory's name)."""
    kept = cfg.model_dump(mode="json", exclude={"log_dir", "ready_file", "fault_control_file"})
    return portable({**kept, "model": cfg.model.name})


def run_load(
    options: LoadOptions,
    *,
    max_tokens: int,
    seed: int,
    tolerance: float,
    say: Callable[[str], None],
    ready_file: Path | None,
    launch_cfg: ServePairConfig | None,
    compared: list[str] | None,
    trace: TraceLoad | None = None,
) -> list[LoadResult]:
    """The load test on the pair or fleet of ``ready_file``, or on each connector's launched in turn."""
    from kvtool.pair.launch import launched_pair

    def each_rate(info: ReadyFile) -> list[LoadResult]:
        # A sweep's runs in turn, each with sessions of its own seed (none finds an earlier run's prompts).
        return [
            _measure(info, replace(options, session_rate=rate), max_tokens, seed + level, tolerance, say, trace)
            for level, rate in enumerate(options.rates())
        ]

    if ready_file is not None:
        return each_rate(read_ready_file(ready_file))
    if launch_cfg is None:
        raise UserError("--load needs a pair: give --pair READY_FILE or --launch")
    results = []
    for connector in compared or [launch_cfg.connector]:
        store = launch_cfg.store if profile(connector).uses_store else "embedded"  # none lends and holds nothing
        update = {"connector": connector, "log_dir": launch_cfg.log_dir / connector, "store": store}
        cfg = launch_cfg.model_copy(update=update)
        say(f"{connector}: starting its {'fleet' if cfg.is_fleet else 'pair'}")
        with launched_pair(cfg, say) as (info, _procs):
            results += each_rate(info)
    return results


def _measure(
    info: ReadyFile,
    options: LoadOptions,
    max_tokens: int,
    seed: int,
    tolerance: float,
    say: Callable[[str], None],
    trace: TraceLoad | None = None,
) -> LoadResult:
    from kvtool.model import model_vocab_size
    from kvtool.store.admin import open_admin

    target = LoadTarget(info.router or info.consumer, info.model, info.block_size, info.hash_unit)
    shape = LoadShape(
        workload=options.workload,  # type: ignore[arg-type]  (checked: one of LOAD_WORKLOADS)
        sessions=options.sessions,
        block_size=info.block_size,
        vocab_size=model_vocab_size(Path(info.model)),
        max_prompt_tokens=info.max_model_len - max_tokens,
        answer_tokens=max_tokens,
        think_s=options.think_s,
        session_rate=options.session_rate,
        seed=seed,
        trace=trace,
    )
    plans = plan_sessions(shape)
    arrivals = "closed loop" if options.session_rate is None else f"{options.session_rate:g} sessions/s"
    if trace is not None:
        arrivals = f"at the trace's timestamps x {trace.time_scale:g}"
    say(
        f"{info.connector}: {options.load} load, {len(plans)} sessions ({sum(len(p.turns) for p in plans)} requests), "
        f"{options.concurrency} in flight at most, {arrivals}, to {target.url}"
    )
    runner = LoadRunner(
        target, options.concurrency, deadline_s=options.duration, check_every=options.check_every, tolerance=tolerance
    )
    watch = _churn_watch(info, options.kill_engine_after, say)
    growing = _join_watch(info, options.add_engine_after, say)
    run = runner.run(plans)
    churn = watch.stop() if watch is not None else None
    join = growing.stop() if growing is not None else None
    summary = summarize(run.records, options.slo_ttft_ms)
    keys = open_admin(info.admin).key_count() if info.admin else None
    fleet = {"engines": len(info.engines) or 2, "router": info.router, "router_policy": info.router_policy}
    phases = phase_summaries(run.records, churn, options.slo_ttft_ms) if churn is not None else None
    if join is not None:
        phases = join_phases(run.records, join, options.slo_ttft_ms)
    return LoadResult(info.connector, fleet, summary, run, keys, options.session_rate, churn, phases, join)


def _join_watch(info: ReadyFile, add_after_s: float | None, say: Callable[[str], None]) -> JoinWatch | None:
    """``--add-engine-after``: the watch of the router's list that asks the fleet for one engine more."""
    if add_after_s is None:
        return None
    log_dir, engines = fleet_to_grow(info)
    assert info.router is not None  # fleet_to_grow() holds it
    say(f"{info.connector}: engine {engines + 1} is asked for {add_after_s:g} s into the load")
    return JoinWatch(RouterWorkers(info.router), log_dir, engines, add_after_s).start()


def _churn_watch(info: ReadyFile, kill_after_s: float | None, say: Callable[[str], None]) -> RotationWatch | None:
    """``--kill-engine-after``: the watch of the router's list that kills the fleet's last engine."""
    if kill_after_s is None:
        return None
    engine, url, pid = victim(info)
    assert info.router is not None  # victim() holds it
    say(f"{info.connector}: {engine} (pid {pid}) is killed {kill_after_s:g} s into the load")
    return RotationWatch(RouterWorkers(info.router), engine, url, pid, kill_after_s).start()
