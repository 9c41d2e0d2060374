#!/usr/bin/env bash
# ui-tests.sh - the labextension's checks, part of `make test`: the panel's types generated from the
# API's schema are the ones committed (src/contract.ts), ESLint + Prettier, TypeScript type checks
# (extension and tests), then Galata/Playwright UI tests in Debian's Chromium (installed here
# with apt when missing; Playwright never downloads a browser). Screenshots are kept in
# labextension/ui-tests/test-results/screenshots.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
log() { printf 'ui-tests: %s\n' "$*" >&2; }

CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"
if [ ! -x "$CHROMIUM" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing Debian's chromium"
    export DEBIAN_FRONTEND=noninteractive
    timeout 900 apt-get install -y --no-install-recommends chromium >/dev/null \
      || { timeout 600 apt-get update >/dev/null && timeout 900 apt-get install -y --no-install-recommends chromium >/dev/null; }
  else
    log "ERROR: $CHROMIUM is missing: install Debian's chromium (apt-get install chromium) or set CHROMIUM"
    exit 1
  fi
fi
export CHROMIUM PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 PATH="$ROOT/.venv/bin:$PATH"

cd labextension
log "generated types: src/contract.ts against the API's schema"
FRESH="$(mktemp --suffix=.ts)"
trap 'rm -f "$FRESH"' EXIT
node scripts/gen-types.mjs "$FRESH"
if ! diff -u src/contract.ts "$FRESH" >&2; then
  log "ERROR: labextension/src/contract.ts is not what client/jupyter_gpumigrate_client/contract/api.schema.json generates" \
      "(the diff is above): run \`npm run gen:types\` in labextension/ and commit src/contract.ts."
  exit 1
fi
log "lint (eslint, prettier)"
npm run --silent lint
log "type check (tsc)"
npm run --silent typecheck
cd ui-tests
rm -rf test-results
log "Galata UI tests in $("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM")"
timeout 1200 npx playwright test "$@"
log "screenshots: $(ls test-results/screenshots 2>/dev/null | tr '\n' ' ')"
