# The two commands a newcomer needs: `make demo` and `make test`. Both set up what is missing.
VENV ?= .venv
BIN := $(VENV)/bin
TEST_MODEL ?= smollm2-135m-instruct
# Document size factor of the demo corpus: 0.3 gives documents of 6K, 14K and 27K tokens (each
# of two segments or more, one over 16K); from a fresh clone `make demo` took 15.7 minutes on a
# 2-core EPYC run as an AVX2-only CPU (docs/performance.md). 1.0 gives 20K-90K.
DEMO_SCALE ?= 0.3
# `make bench` on a quiet 2-core Intel Xeon with AMX (bfloat16): 44 minutes for the first four
# benchmarks (15 of them the 1M-token document of the scaling run; 111 minutes on an earlier
# bfloat16 host), plus 87 for the full-size corpus_efficiency run (4-5 hours estimated on an
# AVX2-only EPYC). BENCH_ARGS=--quick runs small sizes; --with-serving adds the slow serving
# benchmark. Results: bench/results/SUMMARY.md.
BENCH_ARGS ?=
# `make soak`: `memstream serve` with the default engine under mixed load from locust for 5
# minutes (bench/soak.py); results in bench/results/soak.md. SOAK_ARGS go to the script (e.g.
# --minutes 1 --openai-stub, which needs no model).
SOAK_ARGS ?=
# `make train`: the CPU demonstration of Multi-Conv DAPO (bench/train_demo.py); resumes a run
# that was stopped. TRAIN_ARGS go to the script (e.g. --steps 10).
TRAIN_ARGS ?=
# `make train-default`: Multi-Conv DAPO on the default model (qwen2.5-coder-0.5b-instruct, LoRA
# rank 8) in the format users run: its default strategy verified-quotes, the multi-fact and
# filing-figures tasks in turn, 1,000-token chunks and a 256-token memory (the longest the time
# box affords; docs/guide/training.md#training-the-default-model), the learner in
# TRAIN_DEFAULT_DTYPE (auto: bfloat16 autocast where the CPU has native bf16, 2.7x float32 there,
# bench/results/learner_dtype.md; float32 where bf16 is emulated), held-out scored every 5 steps.
# Resumes where it stopped; its log is appended to TRAIN_DEFAULT_OUT/train.log. Hours: start it
# in the background (`nohup make train-default &`) and apply the stop rule in the guide.
# TRAIN_DEFAULT_ARGS go last to `memstream train` (e.g. --steps 1 --samples-per-step 1).
TRAIN_DEFAULT_OUT ?= runs/train-default
TRAIN_DEFAULT_DTYPE ?= auto
TRAIN_DEFAULT_ARGS ?=
# `make train-verl`: the same tasks, templates and reward as verl's inputs for a GPU cluster
# (`memstream train --backend verl`, docs/guide/training.md), written to VERL_OUT; then the files
# go on the volume infra/k8s/rayjob-verl.yaml mounts. VERL_ARGS go to the command (e.g. --model
# Qwen/Qwen2.5-7B-Instruct --group-size 16 --chunk-size 5000; a hub model's tokenizer needs
# HF_HUB_OFFLINE=0 on the command line). Trains nothing here.
VERL_OUT ?= runs/verl
VERL_ARGS ?=
# `make lock`: writes infra/requirements.lock anew from $(VENV) (`pip freeze`, memstream left out):
# the pins of every package of the venv, Airflow's closure included, which infra/setup.sh installs
# with as constraints. After changing a dependency in pyproject.toml: `LOCK= make setup` (installs
# without the lock), then `make lock`.
LOCK_FILE := infra/requirements.lock
# `make audit`: infra/requirements.lock against OSV's advisories with pip-audit (infra/audit.py);
# accepted advisories, each with a reason, in infra/audit-allowlist.toml. Needs api.osv.dev
# (AUDIT_ARGS=--osv-url URL for a mirror); exits 2 with one line when it cannot reach it.
AUDIT_ARGS ?=
# `make test` on TEST_WORKERS processes, a test file at a time each (pytest-xdist), the files
# that take minutes first (tests/conftest.py). TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= 2
TEST_PARALLEL := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup setup-runtime models demo test test-fast docs bench soak lint train train-default \
	train-verl lock audit

setup:
	@bash infra/setup.sh

# What `make demo` needs: a job's packages, without the test, lint and Airflow ones.
setup-runtime:
	@PROFILE=runtime bash infra/setup.sh

models: setup
	$(BIN)/memstream models pull $(TEST_MODEL)

demo: setup-runtime
	$(BIN)/memstream demo --scale $(DEMO_SCALE)

test: setup models docs
	bash infra/services/postgres.sh install
	bash infra/services/chromium.sh install
	PYTHONFAULTHANDLER=1 $(BIN)/pytest -q -ra --durations=30 $(TEST_PARALLEL)

test-fast: setup
	bash infra/services/chromium.sh install
	PYTHONFAULTHANDLER=1 $(BIN)/pytest -q -m "not engine and not server"

# The documentation site: bench/docs_pages.py writes the generated pages (docs/reference/, every
# command's flags from its parser; docs/benchmarks/, from bench/results/), then MkDocs builds the
# site into site/ (git-ignored), failing on any warning (a broken link or anchor). Seconds.
# NO_MKDOCS_2_WARNING: Material's banner about MkDocs 2.0, which pyproject.toml pins below.
docs: setup
	$(BIN)/python bench/docs_pages.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

bench: setup models
	$(BIN)/python bench/run.py $(BENCH_ARGS)

soak: setup models
	PYTHONPATH=. $(BIN)/python bench/soak.py $(SOAK_ARGS)

train: setup models
	$(BIN)/python bench/train_demo.py --resume $(TRAIN_ARGS)

train-default: setup
	$(BIN)/memstream models pull qwen2.5-coder-0.5b-instruct
	mkdir -p $(TRAIN_DEFAULT_OUT)
	$(BIN)/memstream train --output $(TRAIN_DEFAULT_OUT) --resume \
	  --model qwen2.5-coder-0.5b-instruct --template verified-quotes \
	  --task multi-fact+filing-figures --n-segments 3 --segment-tokens 1000 \
	  --chunk-size 1000 --max-memory-tokens 256 --max-answer-tokens 64 \
	  --lora --lora-rank 8 --lora-alpha 16 --learner-dtype $(TRAIN_DEFAULT_DTYPE) \
	  --preset dapo --steps 60 --samples-per-step 4 --group-size 4 \
	  --learning-rate 2e-5 --warmup-steps 4 --mini-batch-conversations 16 \
	  --micro-batch-tokens 2048 \
	  --max-model-len 4096 --kv-cache-gib 2 --heldout-every 5 --heldout-samples 40 \
	  $(TRAIN_DEFAULT_ARGS) >> $(TRAIN_DEFAULT_OUT)/train.log 2>&1

train-verl: setup
	$(BIN)/memstream train --backend verl --output $(VERL_OUT) $(VERL_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/hadolint infra/docker/Dockerfile.cpu infra/docker/Dockerfile.gpu
	$(BIN)/shellcheck infra/setup.sh infra/services/*.sh infra/docker/entrypoint.sh bench/gpu_check.sh

audit: setup
	$(BIN)/python infra/audit.py $(AUDIT_ARGS)

lock:
	@[ -f $(VENV)/.memstream-installed ] && [ $(VENV)/.memstream-installed -nt pyproject.toml ] || \
	  { echo "make lock: $(VENV) is not installed from the current pyproject.toml;" \
	    "run make setup (or LOCK= make setup, which ignores the old lock) first" >&2; exit 1; }
	@{ echo "# Every package of the project's venv (the one infra/setup.sh builds, Airflow's closure"; \
	  echo "# included) at its installed version: pip freeze --exclude-editable, memstream itself left"; \
	  echo "# out. infra/setup.sh installs with it as constraints (-c); tests/test_lock.py checks the venv"; \
	  echo "# against it. Written by \`make lock\` (after \`LOCK= make setup\` to move pins)."; \
	  $(BIN)/python -c 'import platform as p; print(f"# Made on Python {p.python_version()}, {p.system()} {p.machine()}.", end=" ")'; \
	  echo "torch +cpu: find-links or PyTorch's"; \
	  echo "# CPU index. Not pinned: torchvision, torchaudio, torchcodec, triton (setup.sh removes them)."; \
	  $(BIN)/pip freeze --exclude-editable --exclude memstream; } > $(LOCK_FILE).tmp
	@mv $(LOCK_FILE).tmp $(LOCK_FILE)
	@echo "memstream: $(LOCK_FILE) written from $(VENV), $$(grep -c '==' $(LOCK_FILE)) packages"
