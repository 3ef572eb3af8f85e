#!/usr/bin/env bash
# A fleet under load (issue 39): 3 engines of the bench model behind vLLM's router (round robin), agent
# or chat sessions in flight, each connector's fleet launched in turn by `kvtool bench --launch --compare`.
#   benchmarks/fleet/command.sh [BLOCK] [CONNECTORS] [OUT] [STORE] [WORKLOAD] [EXTRA FLAGS...]
# STORE: the fleet's default, standalone (one mooncake_client holds 1 GiB), or embedded (each engine
# lends the store 256 MiB and serves the others' transfers). WORKLOAD: agentic (default) or chat.
# EXTRA FLAGS go to kvtool bench as they are (for example --sweep-rates 0.1,0.2,0.4 --plot FILE).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
BLOCK="${1:-32}"
CONNECTORS="${2:-kvtool,none}"
OUT="${3:-benchmarks/fleet/agentic-block${BLOCK}.json}"
STORE="${4:-standalone}"
WORKLOAD="${5:-agentic}"
shift $(( $# < 5 ? $# : 5 ))
exec .venv/bin/python -m kvtool.cli bench --launch --model-preset bench --engines 3 --router-policy round_robin \
  --block-size "$BLOCK" --store "$STORE" --compare "$CONNECTORS" --load "$WORKLOAD" --sessions 12 --concurrency 4 \
  --think-s 1 --max-tokens 16 --check-every 6 --seed 0 --format json --quiet --output "$OUT" "$@"
