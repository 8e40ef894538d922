# Two commands set everything up on a fresh machine with Python >= 3.11 and make:
#   make quickstart   install, then train/sample/evaluate tiny U-ViT vs U-ViC (CPU, about 4 min)
#   make test         install, then run ruff and the test suite (about 7 min on 2 cores)
#   make test-fast    the suite without the tests marked slow (the inner loop, about 1 min)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install lock quickstart test test-fast lint bench gpu-results gpu-check gpu-wheels gpu-install clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -c constraints.txt -e ".[test]"
	touch $(STAMP)

# constraints.txt afresh: every package a clean install of this checkout resolves now, in
# a fresh virtual environment (LOCK_TMP, removed after), torch and torchvision held at
# their pins. pip's report of that install (a dry run: metadata only, no 6 GB download)
# gives the pins, the Linux-only CUDA packages and triton with torch's marker; the
# file's leading comments stay. docs/development.md says when to run it.
LOCK_TMP ?= /tmp/uvic-lock
LOCK_PINS = import json, re, sys; report = json.load(open(sys.argv[1])); \
	pins = [(i["metadata"]["name"], i["metadata"]["version"]) for i in report["install"] if not i.get("is_direct")]; \
	linux = lambda name: "; platform_system == \"Linux\"" if re.match(r"(nvidia|cuda)-|triton$$", name.lower()) else ""; \
	print("\n".join(f"{n}=={v}{linux(n)}" for n, v in sorted(pins, key=lambda p: p[0].lower())))
lock:
	rm -rf $(LOCK_TMP)
	$(PYTHON) -m venv $(LOCK_TMP)/venv
	$(LOCK_TMP)/venv/bin/python -m pip install -q --upgrade pip
	grep -E '^torch(vision)?==' constraints.txt > $(LOCK_TMP)/held.txt
	$(LOCK_TMP)/venv/bin/python -m pip install -q --dry-run --ignore-installed -c $(LOCK_TMP)/held.txt --report $(LOCK_TMP)/report.json -e ".[test]"
	sed '/^[^#]/,$$d' constraints.txt > $(LOCK_TMP)/constraints.txt
	$(LOCK_TMP)/venv/bin/python -c '$(LOCK_PINS)' $(LOCK_TMP)/report.json >> $(LOCK_TMP)/constraints.txt
	mv $(LOCK_TMP)/constraints.txt constraints.txt
	rm -rf $(LOCK_TMP)

quickstart: install
	$(BIN)/python scripts/quickstart.py $(ARGS)

# One pytest-xdist worker per usable core, at most 4 (each loads torch; tests/conftest.py
# gives each one thread); an idle worker takes tests queued for a busy one (worksteal), so
# the long tests at the end do not leave a core idle.
WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0))))")
test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist worksteal $(ARGS)

test-fast: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist worksteal -m "not slow" $(ARGS)

bench: install
	$(BIN)/python -m uvic_kernels.bench $(ARGS)

# On a GPU machine with the package installed (PY: its python): the full measurements of
# kernels/BENCHMARKS.md in one go, kernels first (they warm Triton's cache), each
# writing its JSON (kernels: runs/bench/kernels.json; the others under kernels/results/).
# It takes a long time: where GPU time is short, run gpu-check instead.
PY ?= $(BIN)/python
gpu-results:
	$(PY) -m uvic_kernels.bench --shapes "128,8,257,64;256,8,334,64;32,8,1024,64;4,8,4096,64"
	$(PY) scripts/bench_train.py --compile off,reduce-overhead --profile --steps 30 --huge
	$(PY) scripts/bench_sampling.py --compile off,reduce-overhead

# The budgeted GPU check: the most valuable measurements first, within
# --budget-s (default 420 s), every finished row in its JSON at once. Run it first on a
# GPU; kernels/BENCHMARKS.md, "The budgeted GPU check", has the whole recipe:
#   here:               make gpu-wheels          (the wheels the GPU machine lacks, .whl/)
#   on the GPU machine: make gpu-install gpu-check PY=python3
# `make gpu-check ARGS=--smoke` runs its tiny CPU smoke anywhere.
gpu-check:
	$(PY) -m uvic.cli.gpu_check $(ARGS)

# The wheels of gpu-wheels.txt for the GPU machine's Python 3.12 (x86-64 manylinux), into
# WHEELS (ignored; carried there, under the device tool's 64 MiB: about 9 MiB).
WHEELS ?= .whl
GPU_PLATFORMS := $(foreach p,manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64,--platform $(p))
gpu-wheels:
	rm -rf $(WHEELS)
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $(GPU_PLATFORMS) -d $(WHEELS) -r gpu-wheels.txt
	du -sh $(WHEELS)

# On the GPU machine (PY=python3, the one with its torch): the carried wheels and this
# checkout, without dependencies (its torch, triton, torchvision and accelerate stay),
# setuptools only where the machine's is older than the 77 pyproject.toml needs.
gpu-install:
	$(PY) -m pip install -q --no-index --no-deps --no-compile $$(ls $(WHEELS)/*.whl | grep -v /setuptools-)
	$(PY) -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" || $(PY) -m pip install -q --no-index --no-deps $(WHEELS)/setuptools-*.whl
	$(PY) -m pip install -q --no-index --no-deps --no-build-isolation -e .

clean:
	rm -rf $(VENV) runs/quickstart
