"""Stream gap: the worst inter-token gap of a running stream while other requests save long prompts,
kvtool against no connector, side by side in one run.

An offline engine (vLLM's ``LLM``, in this process's child, engine core in-process so every step is
timed without HTTP in between) decodes one stream (``ignore_eos``); once it runs, ``--savers``
requests with ``--prompt-tokens``-token prompts arrive together and are prefilled in chunks
(``--chunk`` tokens a step) beside the stream. With kvtool (``kv_producer``, a loopback master this
script starts, the producer lending the store its memory) every one of them is saved: the copy into
the save area at the end of the step that completes its prompt, then the put thread's checksums and
transfer while the stream goes on. The stream's gaps are timed from the step the savers arrive until
``--tail-s`` after the last of them ended (the puts). Connectors alternate, ``--rounds`` each, so drift
on a shared machine hits both alike. Reported: worst and p99 gap per connector,
``stream_gap_vs_none`` (the worst gap of all rounds, kvtool over none; issue 19's goal: at most 1.2)
and ``stream_gap_round_median_vs_none`` (the median of the rounds' worst gaps, likewise).

    .venv/bin/python benchmarks/fast-path/stream_gap.py --out benchmarks/fast-path/stream_gap.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.update({"MC_TCP_BIND_ADDRESS": "127.0.0.1", "VLLM_HOST_IP": "127.0.0.1"})
from published import provenance, write_result  # noqa: E402 - the sibling module

CONNECTORS = ("none", "kvtool")


def child(args: argparse.Namespace) -> None:
    """One engine, one connector: prints the stream's gaps as one JSON line."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: steps are timed here
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "6")
    from vllm import LLM, SamplingParams

    transfer = None
    if args.connector == "kvtool":
        transfer = {
            "kv_connector": "KVToolConnector",
            "kv_connector_module_path": "connector.connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "master_server_address": args.master,
                "global_segment_size": args.segment_mib << 20,
            },
        }
    llm = LLM(
        model=args.model,
        dtype="float32",
        block_size=32,
        max_model_len=args.prompt_tokens + 1024,
        max_num_batched_tokens=args.chunk,
        enforce_eager=True,
        seed=0,
        kv_transfer_config=transfer,
    )
    engine = llm.llm_engine
    rng = random.Random(args.seed)
    warm = [rng.randrange(10, 1000) for _ in range(args.chunk + 100)]  # a chunked prefill, then decode
    llm.generate([{"prompt_token_ids": warm}], SamplingParams(max_tokens=4, detokenize=False), use_tqdm=False)

    decode = SamplingParams(max_tokens=100_000, ignore_eos=True, detokenize=False)
    engine.add_request("stream", {"prompt_token_ids": [rng.randrange(10, 1000) for _ in range(16)]}, decode)
    tokens = 0
    while tokens < 8:
        for output in engine.step():
            if output.request_id == "stream":
                tokens = len(output.outputs[0].token_ids)
    savers = {f"save-{i}" for i in range(args.savers)}
    for req_id in sorted(savers):
        prompt = [rng.randrange(10, 1000) for _ in range(args.prompt_tokens)]
        engine.add_request(req_id, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, detokenize=False))
    arrived = last = time.perf_counter()
    gaps, steps, ended_at = [], [], None
    while ended_at is None or time.perf_counter() - ended_at < args.tail_s:
        start = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        steps.append(now - start)
        for output in outputs:
            if output.request_id == "stream" and len(output.outputs[0].token_ids) > tokens:
                tokens = len(output.outputs[0].token_ids)
                gaps.append(now - last)
                last = now
            elif output.request_id in savers and output.finished:
                savers.discard(output.request_id)
        if not savers and ended_at is None:
            ended_at = now
    engine.abort_request(["stream"])
    print("RESULT " + json.dumps({"gaps_s": gaps, "steps_s": steps, "savers_s": ended_at - arrived}), flush=True)


def run_child(args: argparse.Namespace, connector: str, master: str) -> dict:
    argv = [sys.executable, __file__, "--child", connector, "--master", master, "--model", args.model]
    for name in ("savers", "prompt_tokens", "chunk", "tail_s", "segment_mib", "seed"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1200)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"the {connector} engine failed:\n{done.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def summary(runs: list[dict]) -> dict:
    gaps = sorted(g for run in runs for g in run["gaps_s"])
    return {
        "gap_ms_max": round(1e3 * gaps[-1], 1),
        "gap_ms_p99": round(1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 1),
        "gap_ms_p50": round(1e3 * statistics.median(gaps), 1),
        "gap_ms_max_by_round": [round(1e3 * max(run["gaps_s"]), 1) for run in runs],
        "stream_tokens": len(gaps),
        "savers_done_s_by_round": [round(run["savers_s"], 2) for run in runs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", choices=CONNECTORS)
    parser.add_argument("--master")
    parser.add_argument("--model")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--savers", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--tail-s", type=float, default=3.0)
    parser.add_argument("--segment-mib", type=int, default=1536)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.child:
        args.connector = args.child
        child(args)
        return
    from kvtool.model import ensure_default_model
    from kvtool.store.master import LocalMaster

    args.model = args.model or str(ensure_default_model(preset="long"))
    master = LocalMaster().start()
    address = master.address
    runs: dict[str, list[dict]] = {name: [] for name in CONNECTORS}
    try:
        for number in range(args.rounds):
            for connector in CONNECTORS if number % 2 == 0 else reversed(CONNECTORS):
                runs[connector].append(run_child(args, connector, address))
                print(connector, summary(runs[connector][-1:]), flush=True)
    finally:
        master.stop()
    result = {name: summary(found) for name, found in runs.items()}
    result["stream_gap_vs_none"] = round(result["kvtool"]["gap_ms_max"] / result["none"]["gap_ms_max"], 3)
    result["stream_gap_p99_vs_none"] = round(result["kvtool"]["gap_ms_p99"] / result["none"]["gap_ms_p99"], 3)
    # Each round's worst gap, the median over rounds: a round the shared machine slowed as a whole
    # (every step, connector or not) moves it less than the worst of all rounds.
    medians = {name: statistics.median(result[name]["gap_ms_max_by_round"]) for name in CONNECTORS}
    result["stream_gap_round_median_vs_none"] = round(medians["kvtool"] / medians["none"], 3)
    result["configuration"] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": args.model,
        "savers": args.savers,
        "prompt_tokens": args.prompt_tokens,
        "max_num_batched_tokens": args.chunk,
        "rounds": args.rounds,
        "tail_s": args.tail_s,
        "kvtool": "kv_producer, block 32, hash unit 1, embedded store (the engine lends "
        f"{args.segment_mib} MiB), loopback master",
        **provenance(),
    }
    write_result(result, args.out)


if __name__ == "__main__":
    main()
