# Two commands do everything on a fresh machine:  make demo  |  make test
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup test test-all lint typecheck demo clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "torch==2.14.1" "torchvision==0.29.1"
	$(BIN)/pip install --quiet -e ".[dev,wandb]"
	touch $(STAMP)

setup: $(STAMP)

# Other CPU kernels than this machine's: ATen's baseline kernels, MKL's compatible code path, oneDNN capped at SSE4.1.
# The golden runs are repeated under them: their portable (fp64) check must hold on any CPU (tests/golden.py).
# Only eager runs: torch.compile's on-disk kernel cache is not keyed by ATEN_CPU_CAPABILITY (torch 2.14.1), and a
# compiled run under other kernels after one under the machine's own computes garbage from the cached kernels.
OTHER_CPU_KERNELS := ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPAT ONEDNN_MAX_CPU_ISA=SSE41

test: $(STAMP)  ## set-up + lint + type check + the default (fast) test suite + the golden runs on other kernels
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/pytest -q
	$(OTHER_CPU_KERNELS) $(BIN)/pytest -q -p no:cacheprovider tests/test_golden_losses.py

test-all: $(STAMP)  ## also the slow tests
	$(BIN)/pytest -q -m "slow or not slow"

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

demo: $(STAMP)  ## set-up + the VAR pipeline on bundled digits (CPU, minutes)
	$(BIN)/trainlab demo

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
