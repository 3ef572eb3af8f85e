"""What a miss costs a consumer: TTFT of prompts nothing stored, kvtool against no connector.

A consumer with the kvtool connector looks every new prompt up before computing it; a miss must cost
no more than that lookup. Each connector's pair is launched as a user would (``kvtool serve-pair
--model-preset bench``, block 32, hash unit 1), and the consumer is sent prompts no one has stored
(new random tokens each; the consumer of a ``pd`` pair never saves), streamed, one at a time with a
pause between them. Pairs run one after another, ``--rounds`` times in turn (kvtool, none, kvtool,
none, ...), so drift on a shared machine hits both alike. Reported: client TTFT p50 per prompt length
and connector, and ``miss_ttft_vs_none`` (kvtool's p50 over none's, per length).

    .venv/bin/python benchmarks/fast-path/consumer_miss.py --out benchmarks/fast-path/consumer_miss.json
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from published import git_head, write_result  # noqa: E402 - the sibling module

from kvtool.client import complete  # noqa: E402
from kvtool.pair.ready import ReadyFile, read_ready_file  # noqa: E402

CONNECTORS = ("kvtool", "none")


def launch(connector: str, workdir: Path, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, dict]:
    """A bench-model pair of ``connector`` (``extra``: more serve-pair flags), once it is ready."""
    ready = workdir / f"ready-{connector}.json"
    argv = [
        sys.executable,
        "-m",
        "kvtool.cli",
        "serve-pair",
        "--model-preset",
        "bench",
        "--connector",
        connector,
        "--ready-file",
        str(ready),
        "--log-dir",
        str(workdir / f"logs-{connector}"),
        *extra,
    ]
    log = open(workdir / f"serve-pair-{connector}.log", "w")  # noqa: SIM115 - closed with the process
    pair = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while not ready.exists():
        if pair.poll() is not None or time.monotonic() > deadline:
            stop(pair)
            raise SystemExit(f"the {connector} pair did not start: see {workdir / f'serve-pair-{connector}.log'}")
        time.sleep(1)
    return pair, read_ready_file(ready)


def stop(pair: subprocess.Popen) -> None:
    if pair.poll() is None:
        pair.send_signal(signal.SIGINT)  # serve-pair stops its master and engines
        try:
            pair.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(pair.pid, signal.SIGKILL)
            pair.wait()


def measure(info: ReadyFile, lengths: list[int], requests: int, rng: random.Random, pause_s: float) -> dict[int, list]:
    ttft: dict[int, list[float]] = {length: [] for length in lengths}
    for index in range(requests + 2):  # the first two of each length warm the engine up
        for length in lengths:
            prompt = [rng.randrange(10, 1000) for _ in range(length)]
            answer = complete(info.consumer, info.model, prompt, max_tokens=4, stream=True)
            if index >= 2:
                ttft[length].append(answer["kvtool_timing"]["ttft_s"] * 1000.0)
            time.sleep(pause_s)
    return ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="100,1190", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--requests", type=int, default=10, help="measured requests per length, pair and round")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--pause-s", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lengths = [int(length) for length in args.lengths.split(",")]
    rng = random.Random(args.seed)
    ttft: dict[str, dict[int, list[float]]] = {c: {length: [] for length in lengths} for c in CONNECTORS}
    with tempfile.TemporaryDirectory(prefix="kvtool-consumer-miss-") as tmp:
        for _ in range(args.rounds):
            for connector in CONNECTORS:
                pair, info = launch(connector, Path(tmp))
                try:
                    for length, values in measure(info, lengths, args.requests, rng, args.pause_s).items():
                        ttft[connector][length] += values
                finally:
                    stop(pair)
    p50 = {c: {str(length): round(statistics.median(v), 1) for length, v in by.items()} for c, by in ttft.items()}
    ratio = {str(length): round(p50["kvtool"][str(length)] / p50["none"][str(length)], 3) for length in lengths}
    result = {
        "what": "client TTFT of consumer misses (prompts nothing stored), kvtool vs no connector",
        "commit": git_head(),
        "command": "python " + " ".join(sys.argv),
        "configuration": {
            "model_preset": "bench",
            "block_size": 32,
            "hash_unit": 1,
            "roles": "pd",
            "requests_per_length": args.requests * args.rounds,
            "pause_s": args.pause_s,
            "seed": args.seed,
            "machine_cpus": os.cpu_count(),
        },
        "ttft_ms_p50": p50,
        "miss_ttft_vs_none": ratio,
        "ttft_ms": {c: {str(length): [round(x, 1) for x in v] for length, v in by.items()} for c, by in ttft.items()},
    }
    write_result(result, args.out)


if __name__ == "__main__":
    main()
