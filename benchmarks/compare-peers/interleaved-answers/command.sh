#!/usr/bin/env bash
# The workloads the interleaved runs (../interleaved) leave out, kvtool against each peer head to head
# (kvtool bench --interleave: both pairs up at once, every step sent to both in turn):
# - answers and divergence points: chat (turn t+1 = turn t + the consumer's real answer + a message),
#   shared-prefix and prefix-repetition, both engines kv_both (--roles both: kvtool's save_answers, the
#   in-tree connector's save_decode_cache, LMCache's saves of decoded KV), on each connector's defaults;
# - the trace at block 256 (prefixes ending inside 256-token blocks: ../trace-256's workload).
# Run from the repository root, after scripts/setup --with-lmcache, nothing else running on the two cores.
set -euo pipefail
out=benchmarks/compare-peers/interleaved-answers
for peer in vllm-mooncake-store lmcache none; do
  COLUMNS=200 .venv/bin/python -m kvtool.cli bench --launch --model-preset bench \
    --compare "kvtool,$peer" --interleave --roles both \
    -w chat -w shared-prefix -w prefix-repetition \
    --requests 12 --max-tokens 8 --seed 0 \
    --output "$out/answers-kvtool-vs-$peer.json" --plot "$out/answers-kvtool-vs-$peer.png" \
    --log-dir "$TMPDIR/kvb/logs-answers-$peer"
  COLUMNS=200 .venv/bin/python -m kvtool.cli bench --launch --model-preset bench --block-size 256 \
    --compare "kvtool,$peer" --interleave \
    -w trace:../shared/traces/mooncake_synthetic_trace.jsonl \
    --trace-start 3977 --trace-requests 16 --trace-block-tokens 48 \
    --requests 16 --max-tokens 4 --seed 0 \
    --output "$out/trace256-kvtool-vs-$peer.json" --plot "$out/trace256-kvtool-vs-$peer.png" \
    --log-dir "$TMPDIR/kvb/logs-trace256-$peer"
done
