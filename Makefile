# Two commands set everything up on a fresh machine with Python >= 3.11 and make:
#   make quickstart   install, then train/sample/evaluate tiny U-ViT vs U-ViC (CPU, ~5 min)
#   make test         install, then run ruff and the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install quickstart test lint bench clean

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

clean:
	rm -rf $(VENV) runs/quickstart
