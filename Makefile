# Two commands on a fresh Linux machine with Python 3.11:
#   make demo   - virtualenv, pinned dependencies, migrate, seed, run the platform (embedded defaults);
#                 make demo PORT=8080 ENGINE_PORT=8180 for other ports,
#                 make demo ENGINE_ARGS="--quantization int8" for more engine flags (python -m engine --help),
#                 make demo DISAGG=1 for a prefill engine and a decode engine (docs/kv-tiers.md),
#                 make demo MODEL=/path/to/checkpoint to serve another checkpoint, e.g. a vision-language one
#                 (Qwen2.5-VL, Qwen3-VL: images through the API; docs/models.md)
#   make test   - the whole test suite (what .ci/run calls)

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed

.PHONY: demo test lint venv services

venv: $(INSTALLED)

$(INSTALLED): requirements/engine.txt requirements/platform.txt requirements/dev.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements/dev.txt
	touch $@

PORT ?= 8000
ENGINE_PORT ?= 8100
ENGINE_ARGS ?=
DISAGG ?=
MODEL ?=

demo: venv
	$(BIN)/python manage.py demo --port $(PORT) --engine-port $(ENGINE_PORT) --engine-args "$(ENGINE_ARGS)" \
		$(if $(DISAGG),--disaggregate) $(if $(MODEL),--model "$(MODEL)")

services:
	.ci/services

test: venv services
	.ci/test

lint: venv
	$(BIN)/ruff check .
