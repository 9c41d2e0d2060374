# The two commands of the README. Each sets up what it needs (CRIU, .venv) first.
.PHONY: lab test setup

LAB_ARGS ?=
PYTEST_ARGS ?=
UI_TEST_ARGS ?=
ROOT_FLAG := $(shell [ "$$(id -u)" = 0 ] && echo --allow-root)

setup:
	@scripts/setup.sh

## Start JupyterLab with jupyter-gpumigrate enabled (its kernels can be suspended and moved).
lab: setup
	.venv/bin/jupyter lab $(ROOT_FLAG) $(LAB_ARGS)

## Run the test suite: real CRIU, real kernels, real jupyter_server (GPU tests skip without a GPU),
## then the labextension's lint, type checks and Galata UI tests in Debian's Chromium.
test: setup
	.venv/bin/python -m pytest -ra --durations=15 $(PYTEST_ARGS)
	scripts/ui-tests.sh $(UI_TEST_ARGS)
