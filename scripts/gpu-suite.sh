#!/usr/bin/env bash
# gpu-suite.sh - run the GPU test suite (and bench/gpu_bench.py) on the lent GPU machine.
#
#   scripts/gpu-suite.sh pack              HERE (network, root): fill .gpukit/ (git-ignored) with
#                                          .gpukit/whl   cp312 manylinux x86_64 wheels: the Jupyter stack,
#                                                        pytest-jupyter[server], ipywidgets, ... and their
#                                                        closure, MINUS what the GPU image already has,
#                                                        plus this project's own wheels (the server's
#                                                        package and jupyter-gpumigrate-client);
#                                          .gpukit/criu  a CRIU bundle (bin/criu + lib/*.so);
#                                          .gpukit/ip    iproute2's ip and its libraries (the GPU image has
#                                                        none; the cross-host test makes network namespaces);
#                                          then checks the kit with a clean python 3.12 here.
#   scripts/gpu-suite.sh run [PYTEST_ARGS] ON THE GPU MACHINE, from a copy of the repo with .gpukit:
#                                          installs the wheels in /tmp/site, CRIU as /usr/local/sbin/criu,
#                                          runs `pytest -m gpu` then bench/gpu_bench.py (if present);
#                                          logs and results go to $OUT (default /tmp/gpu-out).
#
# Typical use: `scripts/gpu-suite.sh pack` here, then the device tool's `run` with
#   carry: [".gpukit"]   command: "scripts/gpu-suite.sh run"   (or "... run -k suspend -x")
# The device tool allows 64 MiB for the whole working tree; pack refuses a kit over 56 MiB.
# One device command may run 10 minutes at most: bound the parts with the variables below.
#
# pack is idempotent: the resolved list is kept in .gpukit/lock.txt (redone only when its inputs
# change), only missing wheels are downloaded, wheels not in the list are removed, the project's
# wheel and the CRIU bundle are always rebuilt.
#
# Environment (pack): GPUKIT_PYTHON  a CPython 3.12 used to resolve and check
#                                    (default /root/.pyenv/versions/3.12.1/bin/python, else python3.12)
#                     GPUKIT_NO_CHECK=1  skip the local check
# Environment (run):  OUT                      results folder (default /tmp/gpu-out)
#                     GPU_SUITE_PYTEST_TIMEOUT wall bound of the whole pytest run, s (default 1800)
#                     GPU_SUITE_BENCH_TIMEOUT  wall bound of bench/gpu_bench.py, s (default 900)
#                     GPU_SUITE_TESTS=0 / GPU_SUITE_BENCH=0  skip the tests / the bench
#                     GPU_SUITE_BENCH_ARGS     arguments for bench/gpu_bench.py (e.g. "--sizes 1,8 --cached= --cpu-sizes=")
#                     GPU_SUITE_BENCH_SCRIPT   the bench to run (default bench/gpu_bench.py; bench/suspend_bench.py
#                                              times GPU suspend and resume through a real server)
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT="$PWD"
KIT="$ROOT/.gpukit"
MAX_KIT_MIB=56

log() { printf 'gpu-suite: %s\n' "$*" >&2; }
die() { printf 'gpu-suite: ERROR: %s\n' "$*" >&2; exit 1; }
usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0" >&2; exit "${1:-0}"; }

# What the tests and the bench need on the GPU machine (pyproject's dependencies and test extra are
# added to these at pack time).
TOP_REQS=(jupyter_server jupyter_client ipykernel ipython pyzmq tornado "pytest-jupyter[server]"
  nbclient nbformat ipywidgets widgetsnbextension jupyterlab_widgets comm pytest-timeout dill)

# The GPU image's Python packages ('cuda' image; /work/.library/device/KINDS.md, "Python packages
# already there", read 2026-11-17). None of these is carried.
ALREADY_THERE="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11
h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax
jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib
mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx
optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp"

export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

PLATFORM_ARGS=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

# Prints which of the given Python distributions' requirements are unmet or missing, judged by what
# the running interpreter sees on sys.path; warnings only. Usage: python - DIST... < <(deps_check_py)
deps_check_py() {
  cat <<'PY'
import sys
from importlib import metadata
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
have = {}
for d in metadata.distributions():
    have.setdefault(canonicalize_name(d.metadata["Name"]), d.version)
bad = 0
for dist in sys.argv[1:]:
    try:
        reqs = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        print(f"  MISSING: {dist}"); bad += 1; continue
    for line in reqs:
        r = Requirement(line)
        if r.marker and not r.marker.evaluate({"extra": ""}):
            continue
        v = have.get(canonicalize_name(r.name))
        if v is None:
            print(f"  {dist} needs {r}: not installed"); bad += 1
        elif r.specifier and not r.specifier.contains(v, prereleases=True):
            print(f"  {dist} needs {r}: found {v}"); bad += 1
print(f"dependency check: {'OK' if not bad else str(bad) + ' problem(s)'} over {len(sys.argv) - 1} carried distributions")
PY
}

# ==================================================================== pack (here)
# quiet CMD...: runs CMD, shows its output without the index's "is ignored" noise, returns its status
quiet() {
  local out rc=0
  out="$(mktemp)"
  "$@" >"$out" 2>&1 || rc=$?
  grep -v "is ignored: it is neither a file nor a directory" "$out" >&2 || true
  rm -f "$out"
  return "$rc"
}

find_py312() {
  local c
  for c in "${GPUKIT_PYTHON:-}" /root/.pyenv/versions/3.12.1/bin/python "$(command -v python3.12 || true)"; do
    if [ -n "$c" ] && [ -x "$c" ] && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      printf '%s\n' "$c"; return 0
    fi
  done
  return 1
}

# resolve_lock PY: writes $KIT/lock.txt (carried: name==version) and $KIT/lock-base.txt (in the
# closure but already on the GPU machine), unless lock.txt's recorded inputs are unchanged.
resolve_lock() {
  local py="$1" tmp reqs_file cons_file inputs
  tmp="$(mktemp -d)"
  reqs_file="$tmp/reqs.txt"; cons_file="$tmp/constraints.txt"
  printf '%s\n' "${TOP_REQS[@]}" >"$reqs_file"
  # the dependencies of both distributions and the test extra (jupyter_server>=2.14,<3, ...): the
  # server's are listed for hatch_build.py, which adds the client pinned to its version
  "$py" - >>"$reqs_file" <<'PY'
import tomllib
main, client = (tomllib.load(open(f, "rb")) for f in ("pyproject.toml", "client/pyproject.toml"))
reqs = (main["tool"]["hatch"]["metadata"]["hooks"]["custom"]["dependencies"] + client["project"]["dependencies"]
        + main["project"]["optional-dependencies"]["test"])
# JupyterHub is for the Hub service's tests, which run in CI, not in the gpu suite: leave it here. The
# client is built here, as the project's wheel is.
for r in reqs:
    if not r.lower().startswith(("jupyterhub", "jupyter-gpumigrate-client")):
        print(r)
PY
  # the versions that the project's .venv uses, where it has them
  if [ -x .venv/bin/python ]; then
    timeout 120 .venv/bin/python -m pip freeze --exclude-editable 2>/dev/null | grep -E '^[A-Za-z0-9_.-]+==' >"$cons_file" || true
  else
    : >"$cons_file"
  fi
  inputs="$( { cat "$reqs_file" "$cons_file"; echo "$ALREADY_THERE"; echo "${PLATFORM_ARGS[*]}"; } | sha256sum | cut -c1-16)"
  if [ -s "$KIT/lock.txt" ] && [ -f "$KIT/lock-base.txt" ] && head -n1 "$KIT/lock.txt" | grep -qx "# inputs: $inputs"; then
    log "lock: inputs unchanged, reusing $KIT/lock.txt"
    rm -rf "$tmp"; return 0
  fi
  log "resolving the closure for CPython 3.12 / manylinux x86_64 ($(wc -l <"$cons_file") pins from .venv)"
  if ! timeout 600 "$py" -m pip install --dry-run --ignore-installed --quiet --report "$tmp/report.json" \
      --target "$tmp/target" "${PLATFORM_ARGS[@]}" -c "$cons_file" -r "$reqs_file" >"$tmp/resolve.log" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$tmp/resolve.log" >&2 || true
    rm -rf "$tmp"
    die "pip could not resolve the requirements (output above)"
  fi
  "$py" - "$tmp/report.json" "$inputs" "$KIT/lock.txt" "$KIT/lock-base.txt" "$ALREADY_THERE" <<'PY'
import json, re, sys
report, inputs, lock, base, there = sys.argv[1:6]
canon = lambda n: re.sub(r"[-_.]+", "-", n).lower()
there = {canon(n) for n in there.split()}
carried, skipped = [], []
for item in json.load(open(report))["install"]:
    m = item["metadata"]
    (skipped if canon(m["name"]) in there else carried).append(f"{canon(m['name'])}=={m['version']}")
with open(lock, "w") as f:
    f.write(f"# inputs: {inputs}\n" + "".join(l + "\n" for l in sorted(carried)))
with open(base, "w") as f:
    f.write("".join(l + "\n" for l in sorted(skipped)))
print(f"gpu-suite: lock: {len(carried)} to carry, {len(skipped)} already on the GPU machine "
      f"({' '.join(sorted(skipped))})", file=sys.stderr)
PY
  rm -rf "$tmp"
}

# lock_diff PY: remove wheels not in lock.txt (the project's aside); print each locked name==version
# that has no wheel yet.
lock_diff() {
  "$1" - "$KIT/lock.txt" "$KIT/whl" <<'PY'
import os, re, sys
from pip._vendor.packaging.version import Version
lock, whl = sys.argv[1:3]
canon = lambda n: re.sub(r"[-_.]+", "-", n).lower()
want = {}
for line in open(lock):
    line = line.strip()
    if line and not line.startswith("#"):
        n, v = line.split("==")
        want[n] = Version(v)
have = {}
for fn in sorted(os.listdir(whl)):
    if not fn.endswith(".whl"):
        continue
    n, v = fn.split("-")[:2]
    n = canon(n)
    if n in ("jupyter-gpumigrate", "jupyter-gpumigrate-client"):
        continue
    if want.get(n) == Version(v) and n not in have:
        have[n] = fn
    else:
        print(f"gpu-suite: removing {fn} (not in the lock)", file=sys.stderr)
        os.remove(os.path.join(whl, fn))
for n, v in sorted(want.items()):
    if n not in have:
        print(f"{n}=={v}")
PY
}

# sync_wheels PY: make .gpukit/whl hold exactly one wheel for each locked name==version.
sync_wheels() {
  local py="$1" missing
  mkdir -p "$KIT/whl"
  missing="$(lock_diff "$py")"
  if [ -n "$missing" ]; then
    log "downloading $(wc -w <<<"$missing") wheel(s): $(tr '\n' ' ' <<<"$missing")"
    # shellcheck disable=SC2086
    quiet timeout 900 "$py" -m pip download -q --no-deps "${PLATFORM_ARGS[@]}" -d "$KIT/whl" $missing \
      || die "pip download failed (output above)"
  else
    log "all $(grep -vc '^#' "$KIT/lock.txt") locked wheels already in $KIT/whl"
  fi
  missing="$(lock_diff "$py")"
  [ -z "$missing" ] || die ".gpukit/whl does not match the lock; still missing: $(tr '\n' ' ' <<<"$missing")"
}

build_project_wheel() {
  local py="$1" whl
  rm -f "$KIT"/whl/jupyter_gpumigrate-*.whl "$KIT"/whl/jupyter_gpumigrate_client-*.whl
  log "building the project's wheels (jupyter-gpumigrate and jupyter-gpumigrate-client)"
  quiet timeout 600 "$py" -m pip wheel -q --no-deps -w "$KIT/whl" . ./client || die "building the project's wheels failed"
  [ -n "$(ls "$KIT"/whl/jupyter_gpumigrate_client-*.whl 2>/dev/null)" ] || die "the client's wheel was not built"
  whl="$(ls "$KIT"/whl/jupyter_gpumigrate-*.whl 2>/dev/null | head -n1)"
  [ -n "$whl" ] || die "the project's wheel was not built"
  unzip -p "$whl" '*.dist-info/entry_points.txt' | grep -q '^gpumigrate-provisioner *=' \
    || die "$whl lacks the jupyter_client.kernel_provisioners entry point gpumigrate-provisioner"
  log "built $(basename "$whl")"
}

make_ip_bundle() {
  # The GPU image lacks iproute2; the cross-host GPU test needs `ip netns` and veth/bridge links.
  local ipbin; ipbin="$(command -v ip)" || die "iproute2's ip is needed here (apt-get install iproute2)"
  rm -rf "$KIT/ip"; mkdir -p "$KIT/ip/bin" "$KIT/ip/lib"
  cp "$ipbin" "$KIT/ip/bin/ip.real"
  # its own libraries, not the C library (the GPU image's glibc is newer)
  ldd "$ipbin" | awk '/=>/ {print $3}' | grep -Ev '/lib(c|m)\.so' | xargs -r -I{} cp -L {} "$KIT/ip/lib/"
  log "bundle: $("$ipbin" -V)"
}

install_ip() {
  command -v ip >/dev/null && return 0
  rm -rf /tmp/ipk; cp -a "$KIT/ip" /tmp/ipk
  printf '#!/bin/sh\n# installed by scripts/gpu-suite.sh run\nLD_LIBRARY_PATH=/tmp/ipk/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec /tmp/ipk/bin/ip.real "$@"\n' >/tmp/ipk/bin/ip
  chmod 0755 /tmp/ipk/bin/ip /tmp/ipk/bin/ip.real
  export PATH="/tmp/ipk/bin:$PATH"
  log "ip: $(ip -V)"
}

make_criu_bundle() {
  local tmpb="$KIT/.criu.new"
  rm -rf "$tmpb"
  timeout 3000 scripts/ensure-criu.sh --bundle "$tmpb"
  rm -rf "$KIT/criu"
  mv "$tmpb" "$KIT/criu"
  LD_LIBRARY_PATH="$KIT/criu/lib" timeout 10 "$KIT/criu/bin/criu" --version | head -n1 | sed 's/^/gpu-suite: bundle: CRIU /' >&2
}

# check_kit PY: the kit plus the GPU image's packages (here: those of the closure, from the index)
# install and import with a clean CPython 3.12, and a kernel runs.
check_kit() {
  local py="$1" chk=/tmp/gpukit-check base=/tmp/gpukit-base dists
  log "local check with $py: installing the kit into $chk"
  rm -rf "$chk" "$base"
  timeout 600 "$py" -m pip install -q --no-index --no-deps --target "$chk" "$KIT"/whl/*.whl \
    || die "the kit's wheels do not install together (--no-index --no-deps)"
  if [ -s "$KIT/lock-base.txt" ]; then
    log "local check: the GPU image's packages the closure needs, into $base: $(tr '\n' ' ' <"$KIT/lock-base.txt")"
    quiet timeout 600 "$py" -m pip install -q --no-deps --only-binary=:all: --target "$base" -r "$KIT/lock-base.txt" \
      || die "could not install the GPU image's packages for the local check"
  fi
  # -S: nothing from the interpreter's own site-packages; the kit comes first, as on the GPU machine
  PYTHONPATH="$chk:$base" timeout 300 "$py" -S - "$chk" "$base" <<'PY' >&2 || die "the local import check failed"
import sys, importlib, importlib.metadata as md
chk, base = sys.argv[1:3]
mods = ["jupyter_server", "jupyter_client", "ipykernel", "IPython", "zmq", "tornado", "nbclient",
        "ipywidgets", "pytest_jupyter", "pytest_jupyter.jupyter_server", "jupyter_gpumigrate",
        "jupyter_gpumigrate.provisioner", "jupyter_gpumigrate_client.contract", "nbformat", "comm", "debugpy"]
for m in mods:
    importlib.import_module(m)
eps = {e.name for e in md.entry_points(group="jupyter_client.kernel_provisioners")}
assert "gpumigrate-provisioner" in eps, eps
used = sorted({(getattr(m, "__file__", None) or "").split(base + "/", 1)[1].split("/")[0]
               for m in list(sys.modules.values()) if (getattr(m, "__file__", None) or "").startswith(base + "/")})
print("gpu-suite: import check OK:", ", ".join(mods))
print("gpu-suite: GPU-image packages these imports loaded (from " + base + "):", " ".join(used) or "none")
# a real kernel, as the tests start it
from jupyter_client.manager import start_new_kernel
km, kc = start_new_kernel(kernel_name="python3")
try:
    out = []
    msg = kc.execute_interactive("import zmq, IPython, ipywidgets; print(40 + 2)", timeout=60,
                                 output_hook=lambda m: out.append(m["content"].get("text", "")))
    assert msg["content"]["status"] == "ok" and "42" in "".join(out), (msg["content"], out)
finally:
    kc.stop_channels(); km.shutdown_kernel(now=True)
print("gpu-suite: a python3 kernel started from the kit and ran a cell")
PY
  dists="$(sed -n 's/==.*//p' "$KIT/lock.txt") jupyter-gpumigrate jupyter-gpumigrate-client"
  # shellcheck disable=SC2086
  PYTHONPATH="$chk:$base" timeout 120 "$py" -S - $dists < <(deps_check_py) | sed 's/^/gpu-suite: /' >&2
}

cmd_pack() {
  [ $# -eq 0 ] || die "pack takes no arguments"
  local py size
  py="$(find_py312)" || die "no CPython 3.12 here (set GPUKIT_PYTHON)"
  command -v unzip >/dev/null || die "unzip is needed"
  mkdir -p "$KIT/whl"
  git check-ignore -q "$KIT" || log "WARNING: .gpukit is not git-ignored: add '.gpukit/' to .gitignore"
  resolve_lock "$py"
  sync_wheels "$py"
  build_project_wheel "$py"
  make_criu_bundle
  make_ip_bundle
  # Which code the kit was packed from: run prints it, so that each dated result names its commit.
  { echo "commit $(git rev-parse HEAD)"
    echo "uncommitted changes: $(git status --porcelain --untracked-files=no | wc -l) files"
    echo "sources $(sources_digest)"; } >"$KIT/source.txt"
  [ "${GPUKIT_NO_CHECK:-0}" = 1 ] || check_kit "$py"

  log "wheels carried ($(ls "$KIT"/whl/*.whl | wc -l)):"
  (cd "$KIT/whl" && ls -1 *.whl | sed 's/^\([^-]*\)-\([^-]*\)-.*/  \1 \2/') >&2
  size="$(du -sb "$KIT" | cut -f1)"
  log "kit size: $(du -sh "$KIT/whl" | cut -f1) wheels, $(du -sh "$KIT/criu" | cut -f1) CRIU, total $((size / 1024 / 1024)) MiB ($size bytes)"
  if [ "$size" -gt $((MAX_KIT_MIB * 1024 * 1024)) ]; then
    die ".gpukit is $((size / 1024 / 1024)) MiB, over the $MAX_KIT_MIB MiB allowed (the device tool takes 64 MiB for the whole working tree)"
  fi
  log "ready: call the device tool with carry [\".gpukit\"] and command \"scripts/gpu-suite.sh run\""
}

# ==================================================================== run (GPU machine)
install_criu() {
  local wrapper=/usr/local/sbin/criu
  rm -rf /tmp/criu
  cp -a "$KIT/criu" /tmp/criu
  chmod 0755 /tmp/criu/bin/criu
  local body='#!/bin/sh
# installed by scripts/gpu-suite.sh run: the CRIU bundle of .gpukit/criu
LD_LIBRARY_PATH=/tmp/criu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec /tmp/criu/bin/criu "$@"'
  if [ -e "$wrapper" ] && ! grep -q 'gpu-suite.sh' "$wrapper" 2>/dev/null; then
    mv -f "$wrapper" "$wrapper.orig" || true
  fi
  if mkdir -p /usr/local/sbin 2>/dev/null && printf '%s\n' "$body" >"$wrapper" 2>/dev/null && chmod 0755 "$wrapper"; then
    log "CRIU: $wrapper -> /tmp/criu/bin/criu"
  else
    # /usr/local/sbin not writable: a wrapper on PATH (the project falls back to PATH)
    mkdir -p /tmp/criu/wrap
    printf '%s\n' "$body" >/tmp/criu/wrap/criu; chmod 0755 /tmp/criu/wrap/criu
    export PATH="/tmp/criu/wrap:$PATH"
    log "CRIU: WARNING: $wrapper is not writable; using /tmp/criu/wrap/criu on PATH"
  fi
  hash -r
  echo "--- criu --version"; timeout 20 criu --version 2>&1 || echo "criu --version failed ($?)"
  echo "--- criu check";     timeout 60 criu check 2>&1 | tail -n 25 || echo "criu check failed"
}

# A digest of the two packages' sources as they are in this tree (not git's view: the GPU machine's copy may
# have no .git). pack records it; run compares, so that a kit packed before a change is not measured as if
# it held that change (its wheels are what runs there).
sources_digest() {
  find jupyter_gpumigrate client/jupyter_gpumigrate_client -type f \
      \( -name '*.py' -o -name '*.json' -o -name '*.yaml' -o -name '*.html' \) \
      ! -name _version.py ! -path '*/labextension/*' ! -path '*/__pycache__/*' -print0 \
    | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
}

cmd_run() {
  [ -d "$KIT/whl" ] && [ -x "$KIT/criu/bin/criu" ] \
    || die "$KIT is missing or incomplete: run 'scripts/gpu-suite.sh pack' on the dev machine and carry .gpukit"
  local packed here
  packed="$(sed -n 's/^sources //p' "$KIT/source.txt" 2>/dev/null)"
  here="$(sources_digest)"
  if [ "$packed" != "$here" ] && [ "${GPUKIT_STALE_OK:-0}" != 1 ]; then
    die "the kit's wheels were built from other sources (${packed:-unknown}) than this tree's ($here): run" \
      "'scripts/gpu-suite.sh pack' again on the dev machine (GPUKIT_STALE_OK=1 runs the old wheels anyway)"
  fi
  OUT="${OUT:-/tmp/gpu-out}"
  mkdir -p "$OUT"
  export OUT PYTHONUNBUFFERED=1
  # single-GPU machine, but keep NVLink multicast off as the device notes ask
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

  log "installing $(ls "$KIT"/whl/*.whl | wc -l) wheels into /tmp/site"
  timeout 300 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$KIT"/whl/*.whl || die "installing the wheels failed"
  export PYTHONPATH=/tmp/site
  export PATH="/tmp/site/bin:$PATH"

  install_criu
  [ -d "$KIT/ip" ] && install_ip

  echo "=== environment"
  date -u
  cat "$KIT/source.txt" 2>/dev/null || echo "commit: unknown (packed before source.txt existed)"
  timeout 60 nvidia-smi --query-gpu=index,name,memory.total,driver_version,persistence_mode --format=csv 2>&1 \
    || echo "nvidia-smi failed"
  python3 --version 2>&1
  timeout 180 python3 - <<'PY' 2>&1 || echo "version probe failed"
import importlib.metadata as md
def v(d):
    try:
        return md.version(d)
    except md.PackageNotFoundError:
        return "absent"
try:
    import torch
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, cuda available: {torch.cuda.is_available()})")
except Exception as exc:  # noqa: BLE001
    print(f"torch: import failed: {exc}")
print("cuda-core", v("cuda-core"), "| cuda-bindings", v("cuda-bindings"), "| nvidia-ml-py", v("nvidia-ml-py"),
      "| pytest", v("pytest"), "| pytest-timeout", v("pytest-timeout"))
print("carried: jupyter_server", v("jupyter_server"), "| jupyter_client", v("jupyter_client"),
      "| ipykernel", v("ipykernel"), "| pyzmq", v("pyzmq"), "| tornado", v("tornado"))
PY
  # the carried wheels' requirements against what the image has (warnings only)
  # shellcheck disable=SC2046
  timeout 120 python3 - $(ls "$KIT"/whl/*.whl | sed 's#.*/##; s/-.*//') < <(deps_check_py) 2>&1 \
    || echo "dependency check failed to run"

  local rc=0 brc=0 summary
  if [ "${GPU_SUITE_TESTS:-1}" = 1 ]; then
  echo "=== pytest -m gpu $*"
  set +e
  timeout -k 30 "${GPU_SUITE_PYTEST_TIMEOUT:-1800}" \
    python3 -m pytest -m gpu -rA -p no:cacheprovider --timeout 300 --junitxml "$OUT/gpu-tests.xml" tests "$@" 2>&1 \
    | tee "$OUT/gpu-tests.log"
  rc=${PIPESTATUS[0]}
  set -e
  fi
  [ "$rc" = 124 ] && echo "gpu-suite: pytest ran past GPU_SUITE_PYTEST_TIMEOUT=${GPU_SUITE_PYTEST_TIMEOUT:-1800}s" | tee -a "$OUT/gpu-tests.log"

  local bench="${GPU_SUITE_BENCH_SCRIPT:-bench/gpu_bench.py}"
  if [ "${GPU_SUITE_BENCH:-1}" = 1 ] && [ -f "$bench" ]; then
    echo "=== $bench ${GPU_SUITE_BENCH_ARGS:-}"
    set +e
    # shellcheck disable=SC2086
    PYTHONUNBUFFERED=1 timeout -k 30 "${GPU_SUITE_BENCH_TIMEOUT:-900}" python3 "$bench" ${GPU_SUITE_BENCH_ARGS:-} \
      --out-dir "$OUT" --tag "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1 | tr -cd 'A-Za-z0-9')x$(nvidia-smi -L | wc -l)" 2>&1 \
      | tee "$OUT/bench.log"
    brc=${PIPESTATUS[0]}
    set -e
    [ "$brc" = 0 ] || echo "gpu-suite: $bench exited $brc"
  fi

  echo "=== summary"
  if [ -f "$OUT/gpu-tests.log" ]; then
    summary="$(grep -E '^=+ .*(passed|failed|error|skipped|deselected|no tests ran).* =+$' "$OUT/gpu-tests.log" | tail -n1 || true)"
    echo "pytest: ${summary:-no summary line (see $OUT/gpu-tests.log)} (exit $rc)"
    grep -E '^(PASSED|FAILED|ERROR|SKIPPED) ' "$OUT/gpu-tests.log" >"$OUT/gpu-tests-summary.txt" || true
  fi
  if [ -f "$OUT/bench.log" ]; then
    echo "bench: exit $brc (log $OUT/bench.log, results $OUT/*-bench.json and .png)"
    sed -n '/^# /,$p' "$OUT/bench.log"   # the bench's table, last
  fi
  if [ "$rc" != 0 ]; then exit "$rc"; fi
  exit "$brc"
}

case "${1:-}" in
  pack) shift; cmd_pack "$@" ;;
  run) shift; cmd_run "$@" ;;
  -h|--help|help) usage 0 ;;
  *) usage 2 ;;
esac
