#!/usr/bin/env bash
# kvtool against each peer, head to head, each pair of pairs interleaved (kvtool bench --interleave: both
# pairs up at once, every step sent to both in turn). Four pairs at once do not fit in 24 GiB; two do.
# Run from the repository root, after scripts/setup --with-lmcache, nothing else running on the two cores.
# The trace window is its last 36 requests (3953-3988): with 12 (3977-3988, before b081efd) the trace's
# p50 was the mean of two short misses, a lookup's round trip and the machine's noise apart. Twelve requests
# of each synthetic workload (six before 9b81107: one slow request moved a workload's p50 by a millisecond).
set -euo pipefail
out=benchmarks/compare-peers/interleaved
for peer in vllm-mooncake-store lmcache none; do
  COLUMNS=200 .venv/bin/python -m kvtool.cli bench --launch --model-preset bench \
    --compare "kvtool,$peer" --interleave \
    -w sub-block -w cross-block -w multi-turn -w trace:../shared/traces/mooncake_synthetic_trace.jsonl \
    --trace-start 3953 --trace-requests 36 --trace-block-tokens 12 \
    --requests 12 --max-tokens 4 --seed 0 \
    --output "$out/kvtool-vs-$peer.json" --plot "$out/kvtool-vs-$peer.png" \
    --log-dir "$TMPDIR/kvb/logs-interleaved-$peer"
done
