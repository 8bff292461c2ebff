# The two commands of README.md. Both create or reuse .venv in this checkout.
PROMPT ?= What is the capital of France?

.PHONY: demo test lint test-py313

demo:
	@scripts/setup.sh
	.venv/bin/pagedllm generate "$(PROMPT)"

# Lint and types first (seconds), then the suite, then the package on Python 3.13 (test-py313).
# pytest exits 5 when it collected no tests: that must fail, not pass silently.
test: lint
	.venv/bin/python -m pytest -ra $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc
	@scripts/test-second-python.sh

# A second interpreter: .venv313, `pagedllm generate` and a few test files (skipped without python3.13)
test-py313:
	@scripts/test-second-python.sh

lint:
	@scripts/setup.sh test
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy
