"""Soak run: mixed requests on real pairs, with store faults drawn at random and the master killed and frozen.

One invocation launches, one after another, a producer/consumer pair (`serve-pair --roles pd`) and
a pair of two `kv_both` engines (`--roles both`), and on each runs ``--iterations`` iterations:

- the producer publishes a prompt (max_tokens=1; half of them extend an earlier prompt), the soak
  waits (bounded) for the save's final watermark record, then the consumer answers a continuation
  (4 tokens, top-5 logprobs), compared with a full recomputation (a request with prompt_logprobs,
  which skips every cache);
- on the `both` pair the producer's own answer is verified too (it loads what the consumer
  published), the consumer's continuations join the pool of prompts later ones extend, and half the
  iterations also send the producer a prompt sharing a prefix with the continuation the consumer just
  published (its kv_both load), verified likewise;
- a fault plan drawn at random (connector/faults.py) is active for part of the iterations;
- the master is SIGKILLed (serve-pair restarts it and rewrites the ready file) and frozen with
  SIGSTOP for a few seconds (then SIGCONT; serve-pair may replace it first) at spread iterations,
  while the requests go on; requests in flight while the master was down or frozen are counted.

It reports per pair: requests, faults by kind, master kills and freezes, mismatches (an answer that
differs from its recomputation) and hangs (a request not answered within its time-out, or a save
pipeline that never again ends a save). Expected: 0 mismatches, 0 hangs, 0 errors.

    scripts/run python benchmarks/soak/soak.py --iterations 300 --seed 1 --out benchmarks/soak/results.json

Not part of CI: it runs for about a quarter of an hour.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # the sibling modules, then the repo root (kvtool, connector)

from master import plan_events  # noqa: E402
from pair import REPO, Pair  # noqa: E402
from pair_soak import PairSoak  # noqa: E402
from report import pair_report, run_result  # noqa: E402

from kvtool.pair.ready import ReadyFile  # noqa: E402
from kvtool.portable import portable  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300, help="iterations per pair")
    parser.add_argument("--roles", default="pd,both", help="pairs to run, one after another")
    parser.add_argument("--fault-rate", type=float, default=0.4, help="share of iterations run under a fault")
    parser.add_argument(
        "--shared-prefix-rate",
        type=float,
        default=0.5,
        help="both: share of iterations that send the producer a prompt sharing the consumer's just-published prefix",
    )
    parser.add_argument("--kills", type=int, default=2, help="master SIGKILLs per pair")
    parser.add_argument("--freezes", type=int, default=2, help="master SIGSTOPs per pair")
    parser.add_argument("--freeze-seconds", default="3,8", help="how long each freeze lasts, cycled")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "soak" / "results.json")
    args = parser.parse_args()
    args.roles_list = [r.strip() for r in args.roles.split(",") if r.strip()]
    if not args.roles_list or any(r not in ("pd", "both") for r in args.roles_list):
        parser.error("--roles: a comma-separated list of pd and both")
    args.freeze_list = [float(s) for s in args.freeze_seconds.split(",")]
    return args


def main() -> int:
    args = parse_args()
    began = time.monotonic()
    reports: dict[str, dict] = {}
    pair_info: ReadyFile | None = None
    for roles in args.roles_list:
        workdir = Path(tempfile.mkdtemp(prefix=f"kvtool-soak-{roles}-"))
        pair = Pair(workdir, roles)
        print(f"starting serve-pair --roles {roles} (logs in {workdir})", flush=True)
        soak = None
        try:
            info = pair.start()
            pair_info = info
            print(f"pair ready: {info.producer} {info.consumer} master {info.master}", flush=True)
            soak = PairSoak(pair, args, random.Random(f"{args.seed}:{roles}"))
            events = plan_events(args.iterations, args.kills, args.freezes, args.freeze_list)
            soak.run(events, roles)
        finally:
            code = pair.stop()
            print(f"serve-pair --roles {roles} stopped (exit {code})", flush=True)
        reports[roles] = pair_report(soak, time.monotonic() - soak.started)
        brief = {k: reports[roles][k] for k in ("requests_total", "mismatches", "hangs", "errors", "wall_s")}
        print(f"{roles}: {json.dumps(brief)}", flush=True)

    result = run_result(args, reports, pair_info, time.monotonic() - began)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(portable(result), indent=2) + "\n")
    summary = {
        k: result[k]
        for k in ("requests_total", "master_kills", "master_freezes", "mismatches", "hangs", "errors", "wall_s")
    }
    print(json.dumps(summary))
    return 1 if result["mismatches"] or result["hangs"] or result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
