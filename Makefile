# The two commands of README.md. Both create or reuse .venv in this checkout.
PROMPT ?= What is the capital of France?

.PHONY: demo test lint test-py313

demo:
	@scripts/setup.sh
	.venv/bin/pagedllm generate "$(PROMPT)"

# Lint and types first (seconds), then the suite in two pytest runs that share one cache (the
# kernels built and the default model converted once): the tests that only compute, on
# TEST_WORKERS xdist workers of a core each, whole files at a time (a module's server or engine
# is started once); then those marked serial (they measure memory, threads or time) alone on
# the machine. It fails if either run fails. pytest exits 5 when it collected no tests: one run
# may (PYTEST_ARGS chose no test of its part), both must not: that fails, not passes silently.
# Last, the package on Python 3.13 (test-py313).
TEST_WORKERS ?= 2
test: lint
	cache=$$(mktemp -d); export PAGEDLLM_TEST_CACHE="$${PAGEDLLM_TEST_CACHE:-$$cache}"; \
	.venv/bin/python -m pytest -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --serial=skip $(PYTEST_ARGS); \
	parallel=$$?; \
	.venv/bin/python -m pytest -ra --serial=only $(PYTEST_ARGS); \
	serial=$$?; \
	rm -rf "$$cache"; \
	if [ $$parallel -eq 5 ] && [ $$serial -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; \
	for rc in $$parallel $$serial; do [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || exit $$rc; done
	@scripts/test-second-python.sh

# A second interpreter: .venv313, `pagedllm generate` and a few test files (skipped without python3.13)
test-py313:
	@scripts/test-second-python.sh

lint:
	@scripts/setup.sh test
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy
