# Two commands set everything up on a fresh machine with Python >= 3.11 and make:
#   make quickstart   install, then train/sample/evaluate tiny U-ViT vs U-ViC (CPU, about 5.5 min)
#   make test         install, then run ruff and the test suite (about 10 min on 2 cores)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install quickstart test lint bench gpu-results clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -c constraints.txt -e ".[test]"
	touch $(STAMP)

quickstart: install
	$(BIN)/python scripts/quickstart.py $(ARGS)

test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q $(ARGS)

bench: install
	$(BIN)/python -m uvic_kernels.bench $(ARGS)

# On a GPU machine with the package installed (PY: its python): the measurements of
# kernels/BENCHMARKS.md in one go, kernels first (they warm Triton's cache), each
# writing its JSON (kernels: runs/bench/kernels.json; the others under kernels/results/).
PY ?= $(BIN)/python
gpu-results:
	$(PY) -m uvic_kernels.bench --shapes "128,8,257,64;256,8,334,64;32,8,1024,64;4,8,4096,64"
	$(PY) scripts/bench_train.py --compile off,reduce-overhead --profile --steps 30 --huge
	$(PY) scripts/bench_sampling.py --compile off,reduce-overhead

clean:
	rm -rf $(VENV) runs/quickstart
