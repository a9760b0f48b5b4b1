# Two commands a newcomer needs; each does all set-up on a fresh machine (virtual environment outside the
# clone, pip install, the Kafka broker jars via Maven, redis-server via apt-get).
SHELL := /bin/bash
SETUP := bash worker/local/setup_env.sh
PYTEST_ARGS ?=

.PHONY: demo test lint unit bench schemas setup

setup:
	@$(SETUP) >/dev/null

demo:
	@PY=$$($(SETUP) | tail -n1) && PYTHONPATH=$(CURDIR) $$PY -m worker demo

# Everything: lint + types, unit, integration, chaos, chart checks. Starts Kafka and Redis itself.
test:
	@PY=$$($(SETUP) | tail -n1) && cd $(CURDIR) && \
	  $$PY -m ruff check worker schemas tests && \
	  $$PY -m mypy && \
	  PYTHONPATH=$(CURDIR) $$PY -m schemas.export --check && \
	  PYTHONPATH=$(CURDIR) $$PY -m pytest tests -p no:cacheprovider $(PYTEST_ARGS)

unit:
	@PY=$$($(SETUP) | tail -n1) && PYTHONPATH=$(CURDIR) $$PY -m pytest tests/unit -q -p no:cacheprovider

lint:
	@PY=$$($(SETUP) | tail -n1) && $$PY -m ruff check worker schemas tests && $$PY -m mypy

schemas:
	@PY=$$($(SETUP) | tail -n1) && PYTHONPATH=$(CURDIR) $$PY -m schemas.export

bench:
	@PY=$$($(SETUP) | tail -n1) && PYTHONPATH=$(CURDIR) $$PY -m tests.bench.run_all
