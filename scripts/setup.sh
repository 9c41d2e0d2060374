#!/usr/bin/env bash
# setup.sh - everything `make lab` and `make test` need, idempotent:
#   CRIU >= 4.2 (scripts/ensure-criu.sh), a virtual environment in .venv with this package
#   installed editable with its lab and test extras. A second run takes a second or two.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf 'setup: %s\n' "$*" >&2; }

scripts/ensure-criu.sh

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  if ! "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      log "installing python3-venv"
      apt-get install -y --no-install-recommends python3-venv >/dev/null \
        || { apt-get update >/dev/null && apt-get install -y --no-install-recommends python3-venv >/dev/null; }
    else
      log "ERROR: $PYTHON cannot create virtual environments: ask an administrator to install python3-venv"
      exit 1
    fi
  fi
  log "creating .venv"
  "$PYTHON" -m venv .venv
fi

# Reinstall only when the project's metadata changed since the last install.
stamp=.venv/.gpumigrate-installed
if [ ! -f "$stamp" ] || [ -n "$(find pyproject.toml hatch_build.py client/pyproject.toml -newer "$stamp" -print -quit)" ]; then
  log "installing jupyter-gpumigrate and its dependencies into .venv (a few minutes the first time)"
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
  # JupyterLab first: building the labextension below needs it.
  .venv/bin/python -m pip install -q --disable-pip-version-check "jupyterlab>=4.2,<5" "hatch-jupyter-builder>=0.9"
  NEED_INSTALL=1
fi

# Node.js >= 20.19 with npm: the labextension's build tools (rspack) and Playwright need it; Debian 12's
# own nodejs is 18.
need_node() {
  command -v node >/dev/null && command -v npm >/dev/null || {
    log "ERROR: Node.js 20.19 or newer and npm are needed to build the JupyterLab extension: install them (nodejs.org, or your distribution's nodejs 20 packages)"; exit 1; }
  node -e 'const [a, b] = process.versions.node.split(".").map(Number); process.exit(a > 20 || (a === 20 && b >= 19) ? 0 : 1)' || {
    log "ERROR: Node.js $(node --version) is too old to build the JupyterLab extension: install Node.js 20.19 or newer"; exit 1; }
}

# The JupyterLab extension (labextension/ -> jupyter_gpumigrate/labextension), rebuilt when its
# sources are newer than the build. npm's own configuration names the registry.
built=jupyter_gpumigrate/labextension/static/style.js
if [ ! -f "$built" ] || [ -n "$(find labextension/src labextension/style labextension/package.json \
      labextension/package-lock.json -newer "$built" -print -quit)" ]; then
  need_node
  log "building the JupyterLab extension (npm ci, then npm run build:prod)"
  (cd labextension && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --no-audit --no-fund --loglevel=error \
     && PATH="$PWD/../.venv/bin:$PATH" npm run --silent build:prod >/dev/null)
fi

# configurable-http-proxy, for the JupyterHub service's tests (and a local hub): npm, into .venv/node.
if [ ! -x .venv/node/node_modules/.bin/configurable-http-proxy ]; then
  need_node
  log "installing configurable-http-proxy (npm) into .venv/node"
  npm install --no-audit --no-fund --loglevel=error --prefix .venv/node configurable-http-proxy@5 >/dev/null
fi

if [ -n "${NEED_INSTALL:-}" ]; then
  # Both distributions of this tree: the client (REST client, contract, Hub service) and the server's
  # package, which depends on the client at its own version (found here, not in a package index).
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ./client -e ".[lab,test]"
  # A .venv from before the split: uninstalling the old jupyter-gpumigrate removed the console script
  # that it used to own and the client now does.
  [ -x .venv/bin/jupyter-gpumigrate-hub ] \
    || .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --force-reinstall -e ./client
  # JupyterLab loads the extension from this checkout (a symbolic link in .venv/share).
  PATH="$PWD/.venv/bin:$PATH" .venv/bin/jupyter labextension develop --overwrite . >/dev/null
  touch "$stamp"
fi
# PyTorch, NumPy and pandas for the transplant tests (tests/test_transplant.py), which carry a model, its optimizer
# and tensors between kernels: a CPU build. GPUMIGRATE_TORCH names another requirement (a plain "torch"
# is a CUDA build of several GB); "none" installs none, and those tests then skip, saying so.
torch_req="${GPUMIGRATE_TORCH:-torch==2.13.0}"
if [ "$torch_req" != none ] && ! .venv/bin/python -c 'import torch, numpy, pandas' 2>/dev/null; then
  log "installing $torch_req, numpy and pandas into .venv (the transplant tests)"
  .venv/bin/python -m pip install -q --disable-pip-version-check "$torch_req" numpy pandas
fi
log "ready: $(.venv/bin/python --version), $(.venv/bin/jupyter server --version 2>/dev/null | head -n1 | sed 's/^/jupyter_server /')"
