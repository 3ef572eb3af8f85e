#!/usr/bin/env bash
# The GPU path's checks on one CUDA GPU (issue 21), in under 8 minutes once installed:
#   1. the connector's copies on CUDA tensors (tests/gpu: streams, events, both KV layouts);
#   2. end-to-end: a producer/consumer pair on the GPU, partial tails and divergence points, every
#      answer checked against a recomputation (tests/e2e/test_partial_tail.py);
#   3. the fast-path data path with the KV cache on the GPU (benchmarks/fast-path/data_path.py --device cuda).
# Results go to $OUT (default benchmarks/gpu/results), with the machine and the head that produced them.
#
#   bash benchmarks/gpu/run.sh                 # installs .venv-gpu first (needs the network once)
#   KVTOOL_GPU_VENV=/path/to/venv bash benchmarks/gpu/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${KVTOOL_GPU_VENV:-.venv-gpu}
OUT=${OUT:-benchmarks/gpu/results}
BACKEND=${KVTOOL_GPU_ATTENTION_BACKEND:-TRITON_ATTN}  # takes the tests' float32 models; FLASH_ATTN does not
mkdir -p "$OUT"

if ! "$VENV/bin/python" -c "import vllm, mooncake" 2>/dev/null; then
    echo "installing the CUDA stack into $VENV (vllm 0.32 with CUDA torch, mooncake-transfer-engine)"
    python3 -m venv "$VENV"
    if ! "$VENV/bin/pip" install -q -e ".[cuda,test]"; then
        echo "error: could not install the CUDA stack into $VENV (it needs the network once); on an offline" \
             "machine, build that venv elsewhere and point KVTOOL_GPU_VENV at it" >&2
        exit 2
    fi
fi
PY="$VENV/bin/python"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'; print(torch.cuda.get_device_name(0))" \
    | tee "$OUT/device.txt"
git rev-parse HEAD > "$OUT/head.txt" 2>/dev/null || true

export VLLM_HOST_IP=127.0.0.1 MC_TCP_BIND_ADDRESS=127.0.0.1
status=0
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/gpu tests/unit/test_devicecopy.py 2>&1 | tee "$OUT/copies.txt" || status=1
KVTOOL_E2E_ATTENTION_BACKEND=$BACKEND timeout 300 "$PY" -m pytest -q -p no:cacheprovider \
    tests/e2e/test_partial_tail.py 2>&1 | tee "$OUT/e2e.txt" || status=1
timeout 120 "$PY" benchmarks/fast-path/data_path.py --device cuda --blocks 48 --rounds 5 \
    --out "$OUT/data_path.json" 2>&1 | tail -5 | tee "$OUT/data_path.txt" || status=1
echo "results in $OUT (exit $status)"
exit $status
