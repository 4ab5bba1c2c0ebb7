# The two commands a fresh machine needs (README): `make demo` and `make test`.
.PHONY: setup setup-sglang demo test test-fast
setup:
	./scripts/setup.sh

# .venv-sglang: SGLang's own model class for export verification (torch 2.14.1; kept apart from .venv)
setup-sglang:
	./scripts/setup_sglang.sh

# prepare -> extract -> vocab -> train on the embedded default (SmolLM2-135M-Instruct + chitchat), on CPU
demo: setup setup-sglang
	.venv/bin/eaglepipe stage=all +experiment=demo

# everything except hardware-bound markers; pytest exit 5 ("no tests ran") is not a failure
test: setup setup-sglang
	.venv/bin/python -m pytest -m "not gpu" -q; rc=$$?; [ $$rc -eq 5 ] && exit 0; exit $$rc

test-fast: setup
	.venv/bin/python -m pytest -m "not slow and not gpu" -q
