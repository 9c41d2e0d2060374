#!/usr/bin/env bash
# ensure-criu.sh - make sure a working CRIU >= 4.2 is available.
#
#   scripts/ensure-criu.sh               check (fast), build + install if needed
#                                        (`jupyter gpumigrate install-criu` runs this, shipped in the wheel)
#   scripts/ensure-criu.sh --print-path  same, then print only the binary's path on stdout
#   scripts/ensure-criu.sh --bundle DIR  same, then copy the binary to DIR/bin and its shared
#                                        libraries (all but libc / ld-linux / vdso) to DIR/lib;
#                                        run elsewhere as LD_LIBRARY_PATH=DIR/lib DIR/bin/criu
#
# Why: Debian 12's criu 3.17 does not start on kernel >= 6.18 and CRIU 4.1 cannot dump TCP
# sockets on kernels >= 6.16 (docs/internals.md, "Which version"). CRIU 4.2.x is built from
# the upstream tarball of Debian's sid source package, fetched from the SAME mirror this
# machine's apt already uses, through a private apt list (the system apt configuration is
# never modified).
#
# Cache: ${XDG_CACHE_HOME:-$HOME/.cache}/jupyter-gpumigrate/criu (sources, apt lists, build, logs).
# Install: /usr/local/sbin/criu.
# Environment: CRIU_MIN_VERSION (default 4.2), CRIU_INSTALL (default /usr/local/sbin/criu),
#              CRIU_SRC_SUITE (default sid), ENSURE_CRIU_COMMAND (how the messages name this command).
set -euo pipefail

MIN_VERSION="${CRIU_MIN_VERSION:-4.2}"
INSTALL_PATH="${CRIU_INSTALL:-/usr/local/sbin/criu}"
SRC_SUITE="${CRIU_SRC_SUITE:-sid}"
CACHE_DIR="${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/jupyter-gpumigrate/criu"
BUILD_DEPS=(gcc make libc6-dev xz-utils pkg-config python3
  libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev protobuf-compiler python3-protobuf
  libnl-3-dev libnet1-dev libcap-dev libbsd-dev libgnutls28-dev libnftables-dev uuid-dev)
JOBS="$(nproc 2>/dev/null || echo 2)"

log() { printf 'ensure-criu: %s\n' "$*" >&2; }
die() { printf 'ensure-criu: ERROR: %s\n' "$*" >&2; exit 1; }

usage() {
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit "${1:-0}"
}

MODE=ensure
BUNDLE_DIR=
while [ $# -gt 0 ]; do
  case "$1" in
    --print-path) MODE=print ;;
    --bundle) [ $# -ge 2 ] || die "--bundle needs a directory"; MODE=bundle; BUNDLE_DIR="$2"; shift ;;
    --bundle=*) MODE=bundle; BUNDLE_DIR="${1#--bundle=}" ;;
    -h|--help) usage 0 ;;
    *) log "unknown argument: $1"; usage 2 ;;
  esac
  shift
done

# ---------------------------------------------------------------- checking a binary
# criu_version BIN -> prints "4.2.1" (empty if it does not run)
criu_version() {
  timeout 10 "$1" --version 2>/dev/null | sed -n 's/^Version: *\([0-9][0-9.]*\).*/\1/p' | head -n1 || true
}

version_ge() { # version_ge A B: A >= B
  [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]
}

CHECK_OUT=
# good_criu BIN: version >= MIN and `criu check` passes. Sets GOOD_VERSION.
good_criu() {
  local bin="$1" v
  [ -x "$bin" ] || return 1
  v="$(criu_version "$bin")"
  if [ -z "$v" ]; then CHECK_OUT="$bin --version failed"; return 1; fi
  if ! version_ge "$v" "$MIN_VERSION"; then CHECK_OUT="$bin is version $v (< $MIN_VERSION)"; return 1; fi
  if ! CHECK_OUT="$(timeout 30 "$bin" check 2>&1)"; then
    # An ordinary user with a CRIU given capabilities (docs/users.md) checks in its unprivileged mode.
    [ "$(id -u)" != 0 ] && CHECK_OUT="$(timeout 30 "$bin" check --unprivileged 2>&1)" || return 1
  fi
  grep -q 'Looks good' <<<"$CHECK_OUT" || return 1
  GOOD_VERSION="$v"
}

find_good_criu() {
  local cand seen=" " c
  local -a cands=("$INSTALL_PATH")
  # every criu on PATH, in PATH order
  local IFS=:
  for d in $PATH; do [ -n "$d" ] && cands+=("$d/criu"); done
  unset IFS
  for c in "${cands[@]}"; do
    [ -x "$c" ] || continue
    cand="$(readlink -f "$c")"
    case "$seen" in *" $cand "*) continue ;; esac
    seen="$seen$cand "
    if good_criu "$c"; then GOOD_BIN="$c"; return 0; fi
    [ -z "$NEAR_BIN" ] && version_ge "$(criu_version "$c")" "$MIN_VERSION" && NEAR_BIN="$c"
    log "not usable: $c (${CHECK_OUT##*$'\n'})"
  done
  return 1
}

# ---------------------------------------------------------------- building
need_root() {
  [ "$(id -u)" = 0 ] && return 0
  local self
  self="${ENSURE_CRIU_COMMAND:-$(readlink -f "$0")}"
  if [ -n "$NEAR_BIN" ]; then
    cat >&2 <<EOF
ensure-criu: ERROR: $NEAR_BIN is CRIU $(criu_version "$NEAR_BIN") but 'criu check' fails for user $(id -un):
ensure-criu: CRIU must run as root (dump/restore need it too). Run this, and CRIU, as root:
    sudo $self
EOF
    exit 1
  fi
  cat >&2 <<EOF
ensure-criu: ERROR: no working CRIU >= $MIN_VERSION found, and building/installing it needs root.
ensure-criu: (CRIU itself also needs root to dump and restore.) Ask an administrator to run:
    sudo $self
ensure-criu: which installs build dependencies with apt-get, builds CRIU from the Debian
ensure-criu: '$SRC_SUITE' source tarball (private apt lists; system apt config is not changed)
ensure-criu: and installs it as $INSTALL_PATH. Or install any CRIU >= $MIN_VERSION on PATH.
EOF
  exit 1
}

# mirror_uri: the Debian archive URI this machine's apt uses (not the security one).
mirror_uri() {
  local codename uri=
  codename="$(. /etc/os-release 2>/dev/null; echo "${VERSION_CODENAME:-}")"
  local f
  # deb822 files: a stanza with Types: deb, whose Suites include the release codename.
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    uri="$(awk -v cn="$codename" '
      function flush() { if (types ~ /(^| )deb( |$)/ && uris != "" && (cn == "" || (" " suites " ") ~ (" " cn " ")) && uris !~ /security/) { split(uris, a, " "); print a[1]; found=1; exit } ; types=""; uris=""; suites="" }
      /^[[:space:]]*$/ { flush(); next }
      /^[Tt]ypes:/  { sub(/^[^:]*:[[:space:]]*/, ""); types=$0 }
      /^URIs:/      { sub(/^[^:]*:[[:space:]]*/, ""); uris=$0 }
      /^Suites:/    { sub(/^[^:]*:[[:space:]]*/, ""); suites=$0 }
      END { if (!found) flush() }' "$f")"
    [ -n "$uri" ] && { echo "$uri"; return 0; }
  done
  # one-line format
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    uri="$(awk -v cn="$codename" '
      $1 == "deb" { i = 2; if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                    if ((cn == "" || $(i+1) == cn) && $i !~ /security/) { print $i; exit } }' "$f")"
    [ -n "$uri" ] && { echo "$uri"; return 0; }
  done
  return 1
}

APT_PRIV=()
private_apt_setup() {
  local uri keyring=/usr/share/keyrings/debian-archive-keyring.gpg opt=
  uri="$(mirror_uri)" || die "could not find the Debian mirror URI in /etc/apt/sources.list.d/*.sources or /etc/apt/sources.list"
  [ -f "$keyring" ] && opt="[signed-by=$keyring] "
  mkdir -p "$CACHE_DIR/apt/lists/partial" "$CACHE_DIR/apt/parts"
  printf 'deb-src %s%s %s main\n' "$opt" "$uri" "$SRC_SUITE" >"$CACHE_DIR/apt/sources.list"
  APT_PRIV=(-o "Dir::Etc::SourceList=$CACHE_DIR/apt/sources.list"
            -o "Dir::Etc::SourceParts=$CACHE_DIR/apt/parts"
            -o "Dir::State::Lists=$CACHE_DIR/apt/lists"
            -o "APT::Sandbox::User=root"
            -o "Acquire::Retries=3" -o "Acquire::http::Timeout=60")
  log "source mirror: $uri (suite $SRC_SUITE, private apt lists in $CACHE_DIR/apt)"
}

install_build_deps() {
  local missing=() p
  for p in "${BUILD_DEPS[@]}"; do
    dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null | grep -q '^ii' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing build dependencies: ${missing[*]}"
  local log_f="$CACHE_DIR/apt-install.log"
  export DEBIAN_FRONTEND=noninteractive
  if ! timeout 900 apt-get install -y --no-install-recommends "${missing[@]}" >"$log_f" 2>&1; then
    log "apt-get install failed; running apt-get update and retrying"
    timeout 600 apt-get update >>"$log_f" 2>&1 || { tail -n 20 "$log_f" >&2; die "apt-get update failed (full log: $log_f)"; }
    timeout 900 apt-get install -y --no-install-recommends "${missing[@]}" >>"$log_f" 2>&1 || {
      tail -n 20 "$log_f" >&2; die "could not install build dependencies (full log: $log_f)"; }
  fi
}

# fetch_source: sets SRC_TARBALL (cached; downloads only when absent)
fetch_source() {
  local dl="$CACHE_DIR/src" dsc log_f="$CACHE_DIR/apt-source.log"
  mkdir -p "$dl"
  SRC_TARBALL="$(ls -1 "$dl"/criu_*.orig.tar.* 2>/dev/null | sort -V | tail -n1 || true)"
  if [ -n "$SRC_TARBALL" ]; then log "using cached source $SRC_TARBALL"; return 0; fi
  private_apt_setup
  log "apt-get update (private, deb-src $SRC_SUITE)"
  timeout 600 apt-get "${APT_PRIV[@]}" update >"$log_f" 2>&1 || {
    tail -n 20 "$log_f" >&2; die "private apt-get update failed (full log: $log_f)"; }
  log "apt-get source --download-only criu"
  # The .debian.tar.xz may 404 (exit 100); the .orig.tar.xz is all we need, so judge by the files.
  (cd "$dl" && timeout 600 apt-get "${APT_PRIV[@]}" source --download-only criu) >>"$log_f" 2>&1 || true
  SRC_TARBALL="$(ls -1 "$dl"/criu_*.orig.tar.* 2>/dev/null | sort -V | tail -n1 || true)"
  [ -n "$SRC_TARBALL" ] || { tail -n 20 "$log_f" >&2; die "apt-get source did not deliver criu_*.orig.tar.* (full log: $log_f)"; }
  # apt checks hashes of what it downloads; check the tarball against the .dsc again anyway.
  dsc="$(ls -1 "$dl"/criu_*.dsc 2>/dev/null | sort -V | tail -n1 || true)"
  if [ -n "$dsc" ]; then
    local want
    want="$(awk -v f="$(basename "$SRC_TARBALL")" '/^Checksums-Sha256:/{s=1;next} /^[^ ]/{s=0} s && $3==f {print $1}' "$dsc")"
    if [ -n "$want" ] && [ "$(sha256sum "$SRC_TARBALL" | cut -d' ' -f1)" != "$want" ]; then
      rm -f "$SRC_TARBALL"; die "sha256 of $(basename "$SRC_TARBALL") does not match $dsc; removed it, run again"
    fi
  fi
  log "downloaded $SRC_TARBALL"
}

build_criu() {
  local ver srcdir log_f="$CACHE_DIR/build.log"
  ver="$(basename "$SRC_TARBALL" | sed 's/^criu_\(.*\)\.orig\.tar\..*$/\1/')"
  srcdir="$CACHE_DIR/build/criu-$ver"
  BUILT_BIN="$srcdir/criu/criu"
  if [ -x "$BUILT_BIN" ] && [ -n "$(criu_version "$BUILT_BIN")" ]; then
    log "using cached build $BUILT_BIN"; return 0
  fi
  rm -rf "$srcdir"; mkdir -p "$srcdir"
  tar -xf "$SRC_TARBALL" -C "$srcdir" --strip-components=1 || die "could not unpack $SRC_TARBALL"
  log "building CRIU $ver (make -j$JOBS criu, log: $log_f)"
  local t0=$SECONDS
  if ! (cd "$srcdir" && timeout 1800 make -j"$JOBS" criu) >"$log_f" 2>&1; then
    log "build failed; last 30 lines of $log_f:"
    tail -n 30 "$log_f" >&2
    die "CRIU build failed (full log: $log_f; source: $srcdir)"
  fi
  [ -x "$BUILT_BIN" ] || die "build finished but $BUILT_BIN is missing (log: $log_f)"
  log "built in $((SECONDS - t0)) s"
}

install_criu() {
  install -D -m 0755 "$BUILT_BIN" "$INSTALL_PATH"
  log "installed $INSTALL_PATH"
  local resolved
  resolved="$(command -v criu 2>/dev/null || true)"
  if [ "$resolved" != "$INSTALL_PATH" ]; then
    log "WARNING: 'criu' on PATH resolves to '${resolved:-nothing}', not $INSTALL_PATH;"
    log "WARNING: put $(dirname "$INSTALL_PATH") ahead of /usr/sbin in PATH (or use the full path)."
  fi
}

# ---------------------------------------------------------------- bundle
make_bundle() {
  local bin="$1" dir="$2" lib
  mkdir -p "$dir/bin" "$dir/lib"
  cp -fL "$bin" "$dir/bin/criu"
  chmod 0755 "$dir/bin/criu"
  while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|ld-linux*|linux-vdso*) continue ;;
    esac
    cp -fL "$lib" "$dir/lib/"
  done < <(ldd "$bin" | awk '/=> \// {print $3} /^[[:space:]]*\// {print $1}')
  if ! LD_LIBRARY_PATH="$dir/lib" "$dir/bin/criu" --version >/dev/null 2>&1; then
    die "bundle in $dir does not run (LD_LIBRARY_PATH=$dir/lib $dir/bin/criu --version)"
  fi
  log "bundle: $dir/bin/criu + $(ls "$dir/lib" | wc -l) libraries in $dir/lib (run with LD_LIBRARY_PATH=$dir/lib)"
}

# ---------------------------------------------------------------- main
GOOD_BIN=
GOOD_VERSION=
NEAR_BIN=
if ! find_good_criu; then
  need_root
  mkdir -p "$CACHE_DIR"
  exec 9>"$CACHE_DIR/.lock"
  flock -n 9 || log "another ensure-criu run holds $CACHE_DIR/.lock; waiting (up to 40 min)"
  flock -w 2400 9 || die "timed out waiting for another ensure-criu run (lock $CACHE_DIR/.lock)"
  if ! find_good_criu; then   # another run may have finished meanwhile
    log "no working CRIU >= $MIN_VERSION; building one"
    install_build_deps
    fetch_source
    build_criu
    good_criu "$BUILT_BIN" || {
      printf '%s\n' "$CHECK_OUT" >&2
      die "the built CRIU ($BUILT_BIN) fails 'criu check' (output above)"; }
    install_criu
    good_criu "$INSTALL_PATH" || { printf '%s\n' "$CHECK_OUT" >&2; die "$INSTALL_PATH fails 'criu check'"; }
    GOOD_BIN="$INSTALL_PATH"
  fi
fi

log "using $GOOD_BIN (CRIU $GOOD_VERSION, criu check: Looks good)"
# The server takes $INSTALL_PATH if it exists, else the first criu on PATH (engine/criu.py): say so if
# that is not the one found good here.
server_pick="$INSTALL_PATH"
[ -x "$server_pick" ] || server_pick="$(command -v criu 2>/dev/null || true)"
if [ -n "$server_pick" ] && [ "$(readlink -f "$server_pick")" != "$(readlink -f "$GOOD_BIN")" ]; then
  log "WARNING: the Jupyter server would run $server_pick, not $GOOD_BIN: set c.GPUMigrateApp.criu_path = \"$GOOD_BIN\""
fi
case "$MODE" in
  print) printf '%s\n' "$GOOD_BIN" ;;
  bundle) make_bundle "$GOOD_BIN" "$BUNDLE_DIR" ;;
esac
