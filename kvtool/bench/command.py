"""What `kvtool bench` does once its flags are parsed: check them, plan the workloads, run them on
each connector's pair (a running one, or one launched per connector); kvtool/commands/bench.py prints."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvtool.commands.output import OutputOptions
from kvtool.commands.pairoptions import PairOptions
from kvtool.portable import portable
from kvtool.errors import UserError
from kvtool.pair.launch import launched_pair
from kvtool.pair.preflight import check_values
from kvtool.procs import ProcessSet
from kvtool.pair.ready import ReadyFile, read_ready_file
from kvtool.pair.config import REPO_ROOT, Reporter, ServePairConfig
from kvtool.pair.profiles import profile
from kvtool.model import model_vocab_size

from .config import CONNECTORS, BenchConfig, build_workload
from .oracle import ideal_hits
from .report import connector_report
from .results import BenchDocument, ConnectorReport
from .interleave import PAIR_PORT_FIELDS, alternate, base_ports, own_ports
from .runner import PairRunner, QuietClock, WorkloadRun, check_reachable
from .workloads.base import Step, WorkloadShape, longest_prompts, prompts_known


@dataclass(frozen=True)
class PlannedWorkload:
    name: str
    steps: list[Step]
    # Ideal reused tokens per consumer step; None when prompts continue answers (chat): the runner
    # then measures every step against what the requests before it computed.
    ideal: dict[int, int] | None


def plan_workloads(config: BenchConfig, block_size: int, hash_unit: int, vocab_size: int, max_model_len: int):
    """Every workload's steps and ideal hits; bad workload input fails here, before any pair starts."""
    shape = WorkloadShape(
        block_size=block_size,
        vocab_size=vocab_size,
        requests=config.requests,
        max_tokens=config.max_tokens,
        max_prompt_tokens=max_model_len - config.max_tokens - 1,
        seed=config.seed,
    )
    planned = []
    for spec in config.workloads:
        workload = build_workload(spec, config)
        steps = workload.steps(shape)
        too_long = max(longest_prompts(steps), default=0)
        if too_long > shape.max_prompt_tokens:
            raise UserError(
                f"workload {spec} makes a {too_long}-token prompt, more than the {shape.max_prompt_tokens} "
                "the engine takes with this --max-tokens; use shorter prompts"
            )
        ideal = ideal_hits(steps, block_size, hash_unit) if prompts_known(steps) else None
        planned.append(PlannedWorkload(workload.label(), steps, ideal))
    return planned


def parse_compare(value: str | None) -> list[str]:
    if value is None:
        return []
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in CONNECTORS]
    if unknown or not names:
        raise UserError(f"--compare {value!r}: use a comma-separated list of {', '.join(CONNECTORS)}")
    if len(set(names)) != len(names):
        raise UserError(f"--compare {value!r} names a connector twice")
    return names


def check_bench_input(config: BenchConfig, pair_file: Path | None, launch: bool, compare: list[str]) -> None:
    """What can be checked before any pair is read, reached or started: where to run, the workloads."""
    if (pair_file is None) == (not launch):
        raise UserError("give either --pair READY_FILE (written by kvtool serve-pair) or --launch")
    if pair_file is not None and compare:
        raise UserError("--compare starts one pair per connector; use it with --launch, not --pair")
    if config.interleave and len(compare) < 2:
        raise UserError("--interleave alternates the pairs of --compare; name two or more connectors with --compare")
    for spec in config.workloads:
        build_workload(spec, config)


def progress_bar(progress_console: Console | None) -> Progress:
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(*columns, console=progress_console, transient=False, disable=progress_console is None)


def run_workloads(
    pair: ReadyFile, config: BenchConfig, planned: list[PlannedWorkload], progress_console: Console | None
) -> list[WorkloadRun]:
    runner = PairRunner(pair, config)
    runner.warm_up()
    runs = []
    total = sum(len(p.steps) for p in planned)
    with progress_bar(progress_console) as progress:
        task = progress.add_task(f"{pair.connector}", total=total)
        for workload in planned:
            progress.update(task, description=f"{pair.connector}: {workload.name}")
            runs.append(runner.run(workload.name, workload.steps, workload.ideal, lambda _: progress.advance(task)))
    return runs


def run_interleaved(
    pairs: dict[str, tuple[ReadyFile, ProcessSet]],
    config: BenchConfig,
    planned: list[PlannedWorkload],
    progress_console: Console | None,
    failures: dict[str, str],
    say: Reporter,
) -> dict[str, list[WorkloadRun]]:
    """Every workload step sent to each pair in turn (kvtool/bench/interleave.py), one quiet clock for
    all; a pair that fails is dropped (its reason in ``failures``), the others go on."""
    quiet = QuietClock(config.quiet_s)
    runners = {name: PairRunner(pair, config, quiet) for name, (pair, _procs) in pairs.items()}

    def failed(name: str, exc: UserError) -> None:
        dead = pairs[name][1].first_dead()
        failures[name] = dead.died_error("while the pair was in use").message if dead is not None else exc.message
        say(f"{name} failed: {failures[name]}")
        del runners[name]

    for name, runner in list(runners.items()):
        try:
            runner.warm_up()
        except UserError as exc:
            failed(name, exc)
    runs: dict[str, list[WorkloadRun]] = {name: [] for name in runners}
    total = sum(len(p.steps) for p in planned)
    with progress_bar(progress_console) as progress:
        tasks = {name: progress.add_task(name, total=total) for name in runners}
        for workload in planned:
            steppers = {}
            for name, runner in runners.items():
                runs[name].append(WorkloadRun(workload.name))
                steppers[name] = runner.stepper(runs[name][-1], workload.steps, workload.ideal)
                progress.update(tasks[name], description=f"{name}: {workload.name}")
            targets = [step.target for step in workload.steps]
            alternate(steppers, targets, lambda name, _target: progress.advance(tasks[name]), failed)
    return {name: runs[name] for name in runners}


def launch_config(cfg: ServePairConfig, connector: str, compare: bool = False) -> ServePairConfig:
    update: dict[str, Any] = {"connector": connector, "log_dir": cfg.log_dir / connector, "ready_file": None}
    if compare and not profile(connector).has_roles:
        # The baseline without a connector has no roles and no store; --roles and --store apply to the others.
        update["roles"], update["store"] = "pd", "embedded"
    return cfg.model_copy(update=update)


@dataclass
class BenchOutcome:
    """What a bench run produced: the document (one report per connector that ran) and failures."""

    document: BenchDocument

    @property
    def reports(self) -> dict[str, ConnectorReport]:
        return self.document.reports

    def failure_error(self) -> UserError | None:
        if not self.document.failures:
            return None
        message = "; ".join(f"{connector} failed: {why}" for connector, why in self.document.failures.items())
        return UserError(message, exit_code=1)


def run_bench(
    config: BenchConfig,
    say: Reporter,
    pair_file: Path | None,
    launch: ServePairConfig | None,
    compare: list[str],
    progress_console: Console | None = None,
) -> BenchOutcome:
    """Run the workloads on the pair in the ready file, or on a pair launched per connector.

    The caller has checked the input with ``check_bench_input`` (before building ``launch``).
    """
    assert (pair_file is None) != (launch is None)
    measured = provenance()  # the checkout as the run starts (files edited during it are not its code)
    failures: dict[str, str] = {}
    if pair_file is not None:
        pair = read_ready_file(pair_file)
        check_reachable(pair)
        planned = plan_workloads(
            config, pair.block_size, pair.hash_unit, model_vocab_size(Path(pair.model)), pair.max_model_len
        )
        runs = run_workloads(pair, config, planned, progress_console)
        reports = {pair.connector: connector_report(runs, pair.block_size)}
        pair_config: dict[str, Any] = {"ready_file": str(pair_file), **pair.model_dump()}
    else:
        assert launch is not None
        for connector in compare or [launch.connector]:  # each pair's values, before the first one starts
            check_values(launch_config(launch, connector, compare=bool(compare)))
        planned = plan_workloads(
            config, launch.effective_block_size, launch.hash_unit, model_vocab_size(launch.model), launch.max_model_len
        )
        # The kvtool connector's pointer grid as the engines resolved it (divergence_grid None: auto).
        pair_config = {**launch.model_dump(mode="json"), "effective_divergence_grid": launch.effective_divergence_grid}
        launched = LaunchedRuns(config, say, launch, compare, planned, progress_console, failures)
        if config.interleave:
            reports, pair_config["interleaved_ports"] = launched.interleaved()
        else:
            reports = launched.one_by_one()

    config_json = portable({**config.model_dump(mode="json"), "command": sys.argv, **measured})
    pair_config = portable(pair_config)  # no path of this machine in a result (kvtool/portable.py)
    return BenchOutcome(BenchDocument(config_json, pair_config, reports, bool(compare), failures))


@dataclass
class LaunchedRuns:
    """A bench run on pairs it launches itself (--launch): one pair per connector, run one after
    another, or all at once with their requests interleaved (--interleave)."""

    config: BenchConfig
    say: Reporter
    launch: ServePairConfig
    compare: list[str]
    planned: list[PlannedWorkload]
    progress_console: Console | None
    failures: dict[str, str]  # connector -> why its run failed

    def one_by_one(self) -> dict[str, ConnectorReport]:
        """One pair at a time: each is stopped before the next starts (they share ports and cores)."""
        connectors = self.compare or [self.launch.connector]
        reports: dict[str, ConnectorReport] = {}
        for connector in connectors:
            one = launch_config(self.launch, connector, compare=bool(self.compare))
            self.say(f"launching a {connector} pair (logs in {one.log_dir})")
            try:
                with launched_pair(one, self.say) as (pair, _procs):
                    runs = run_workloads(pair, self.config, self.planned, self.progress_console)
                    reports[connector] = connector_report(runs, self.launch.effective_block_size)
            except UserError as exc:
                if len(connectors) == 1:
                    raise
                # One connector failing must not throw away the others' results.
                self.failures[connector] = exc.message
                self.say(f"{connector} failed: {exc.message}")
        return reports

    def interleaved(self) -> tuple[dict[str, ConnectorReport], dict[str, dict[str, int]]]:
        """Every pair up at once (the first on the given ports, the others on free ones), then the
        workloads alternated between them step by step; all are stopped at the end. Also each pair's ports."""
        pairs: dict[str, tuple[ReadyFile, ProcessSet]] = {}
        ports: dict[str, dict[str, int]] = {}
        taken = base_ports(self.launch)
        with ExitStack() as stack:
            for slot, connector in enumerate(self.compare):
                one = launch_config(self.launch, connector, compare=True)
                one = own_ports(one, taken) if slot else one
                self.say(
                    f"launching a {connector} pair (logs in {one.log_dir}), {slot + 1} of {len(self.compare)} at once"
                )
                try:
                    pairs[connector] = stack.enter_context(launched_pair(one, self.say))
                except UserError as exc:
                    self.failures[connector] = exc.message
                    self.say(f"{connector} failed: {exc.message}")
                    continue
                ports[connector] = {name: getattr(one, name) for name in PAIR_PORT_FIELDS}
            runs = run_interleaved(pairs, self.config, self.planned, self.progress_console, self.failures, self.say)
        block_size = self.launch.effective_block_size
        return {name: connector_report(runs[name], block_size) for name in self.compare if name in runs}, ports


# Benchmark results (every JSON and plot under benchmarks/ is one): a command that writes several, run
# after run, changes no code the next run measures.
RESULT_FILES = (":(exclude,glob)benchmarks/**/*.json", ":(exclude,glob)benchmarks/**/*.png")


def provenance(repo: Path = REPO_ROOT) -> dict[str, Any]:
    """Where a result is measured: the kvtool commit (``head``, with ``+`` when the checkout has
    uncommitted changes to tracked files other than benchmark results; None where kvtool is not a git
    checkout of its own, e.g. installed into another project's environment), when (``started_at``, UTC)
    and the cores it may use."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "--no-optional-locks", *args], cwd=repo, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    head = git("rev-parse", "--short", "HEAD") if top and Path(top).resolve() == repo.resolve() else None
    if head and git("status", "--porcelain", "--untracked-files=no", "--", ".", *RESULT_FILES):
        head += "+"
    return {
        "head": head,
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }


def replay(
    config: BenchConfig,
    output: OutputOptions,
    pair_options: PairOptions,
    ready_file: Path | None,
    launch: bool,
    compared: list[str] | None,
    plot: Path | None,
) -> None:
    """``kvtool bench`` without ``--load``: check the inputs, replay on the pair (or each connector's),
    print the report, write the plot; a failed run's error last."""
    from kvtool.commands.output import emit

    from .report import bench_report

    check_bench_input(config, ready_file, launch, compared)
    launch_cfg = pair_options.config(report=output.say) if launch else None
    outcome = run_bench(config, output.say, ready_file, launch_cfg, compared, output.progress_console)
    emit(bench_report(outcome.document), output)
    if plot is not None:
        from .plot import write_plot

        write_plot(plot, outcome.reports)
        output.say(f"wrote {plot}")
    failure = outcome.failure_error()
    if failure is not None:
        raise failure
