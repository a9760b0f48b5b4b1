# Two commands a newcomer needs; each does all set-up on a fresh machine (virtual environment outside the
# clone, pip install, the Kafka broker jars via Maven, redis-server via apt-get; not for the demo).
# pipefail: a failed setup_env.sh must stop the recipe, not hand an empty $PY to the next command.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
SETUP := bash worker/local/setup_env.sh
# Runs setup_env.sh and sets PY to the venv's python (its last line of output), or stops the recipe.
GET_PY := PY=$$($(SETUP) | tail -n1) && [ -x "$$PY" ] \
  || { echo "make: worker/local/setup_env.sh failed (see its messages above); nothing was run" >&2; exit 1; }
PYTEST_ARGS ?=
# Seconds per fuzz target, and one target only, for `make fuzz`: make fuzz FUZZ_SECONDS=300 FUZZ_TARGET=config
FUZZ_SECONDS ?= 60
FUZZ_TARGET ?=
# Arguments for `worker demo`, e.g. make demo DEMO_ARGS="--records 20000 --rate 5000".
DEMO_ARGS ?=

.PHONY: demo test lint unit bench schemas setup fuzz

setup:
	@$(SETUP) >/dev/null

# The demo uses no Redis: KIW_SETUP_REDIS=0 spares it the redis-server install (and the sudo it may need).
demo:
	@export KIW_SETUP_REDIS=0; $(GET_PY); PYTHONPATH=$(CURDIR) $$PY -m worker demo $(DEMO_ARGS)

# Everything: lint + types + import contracts, unit, integration, chaos, chart checks. Starts Kafka and
# Redis itself.
test:
	@$(GET_PY); cd $(CURDIR) && \
	  $$PY -m ruff check worker schemas tests && \
	  $$PY -m mypy && \
	  $$(dirname $$PY)/lint-imports --no-cache --no-logo && \
	  PYTHONPATH=$(CURDIR) $$PY -m schemas.export --check && \
	  NO_MKDOCS_2_WARNING=1 $$PY -m mkdocs build --strict --quiet --site-dir $(DOCS_SITE) && \
	  PYTHONPATH=$(CURDIR) $$PY -m pytest tests -p no:cacheprovider $(PYTEST_ARGS)

unit:
	@$(GET_PY); PYTHONPATH=$(CURDIR) $$PY -m pytest tests/unit -q -p no:cacheprovider

lint:
	@$(GET_PY); $$PY -m ruff check worker schemas tests && $$PY -m mypy && \
	  $$(dirname $$PY)/lint-imports --no-cache --no-logo

schemas:
	@$(GET_PY); PYTHONPATH=$(CURDIR) $$PY -m schemas.export

# The documentation site from docs/ (mkdocs.yml), strict: a broken link or anchor fails it. make test builds
# it too. DOCS_SITE: where it goes (site/ is ignored by git).
DOCS_SITE ?= $(CURDIR)/site
.PHONY: docs
docs:
	@$(GET_PY); cd $(CURDIR) && NO_MKDOCS_2_WARNING=1 $$PY -m mkdocs build --strict --site-dir $(DOCS_SITE)

# Each fuzz target (tests/fuzz) for FUZZ_SECONDS: the inputs tried and any failure found (exit 1).
fuzz:
	@$(GET_PY); PYTHONPATH=$(CURDIR) $$PY -m tests.fuzz --seconds $(FUZZ_SECONDS) \
	  $(if $(FUZZ_TARGET),--target $(FUZZ_TARGET))

bench:
	@$(GET_PY); PYTHONPATH=$(CURDIR) $$PY -m tests.bench.run_all
