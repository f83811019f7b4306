#!/usr/bin/env bash
# Creates .venv-bridge: Megatron-Bridge pinned exactly (constraints-bridge.txt) on top of .venv's
# megatron-muon[test] stack (constraints.txt), for `make test-bridge` (docs/megatron_bridge.md).
# .venv is not copied: a .pth file adds its site-packages (and runs its .pth files) after
# .venv-bridge's own, so torch and its nvidia-* wheels (about 5 GB) are on disk once. What Bridge
# needs at another version than .venv has is installed into .venv-bridge, which comes first on
# sys.path; pip never writes into .venv from here ("outside environment").
# Bridge is installed with --no-deps: its declared requirements pull Transformer Engine, which cannot
# install without CUDA, and a torch of their own. What its training path imports is listed in
# constraints-bridge.txt and installed here instead. Two packages need care:
#  - nvidia-resiliency-ext (megatron-core >= 0.19 imports it for Bridge's fault tolerance hooks):
#    PyPI has wheels for glibc >= 2.39 only; its Python code is all Bridge's import needs, so the
#    wheel is unpacked into site-packages (pip --target with that platform tag) when the plain
#    install finds none for this glibc.
#  - transformer_engine: Bridge's peft/lora_layers.py imports it at module level; the tests provide
#    a stand-in for that import only (tests/bridge/te_stand_in), never the package.
# The install is skipped when the same files built the venv (a stamp file).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV_BRIDGE:-.venv-bridge}
BASE=.venv

bash scripts/setup_venv.sh
# $PWD too: the .pth lines below name this checkout's .venv and tests/bridge by absolute path.
stamp_key=$( (cat pyproject.toml constraints.txt constraints-bridge.txt "$0"; echo "$PWD") | sha256sum | cut -c1-16)
stamp="$VENV/.installed-$stamp_key"
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ]; then
  exit 0
fi
py=$("$BASE/bin/python" -c 'import sys; print(sys._base_executable)')
base_site=$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$VENV"
echo "creating $VENV with $py: Megatron-Bridge (constraints-bridge.txt) on $BASE's stack"
"$py" -m venv --without-pip "$VENV"  # pip too comes from $BASE
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$base_site')" > "$site/_megatron_muon_base_venv.pth"
"$VENV/bin/python" -c 'import torch, megatron.core, megatron_muon' || {
  echo "error: $VENV does not see $BASE's packages ($base_site)" >&2; exit 1; }
nvrx=$(grep -i '^nvidia-resiliency-ext==' constraints-bridge.txt)
grep -v -i -e '^#' -e '^$' -e '^nvidia-resiliency-ext==' constraints-bridge.txt > "$VENV/bridge-reqs.txt"
# The Bridge line is --no-deps (above); the rest are plain installs against constraints.txt's stack.
"$VENV/bin/python" -m pip install -q --no-compile --no-deps "$(grep -i '^megatron-bridge==' "$VENV/bridge-reqs.txt")"
"$VENV/bin/python" -m pip install -q --no-compile -c constraints.txt \
  $(grep -v -i '^megatron-bridge==' "$VENV/bridge-reqs.txt")
if ! "$VENV/bin/python" -m pip install -q --no-compile --no-deps --only-binary=:all: "$nvrx" 2>/dev/null; then
  pyver=$("$VENV/bin/python" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
  echo "no $nvrx wheel for this glibc: unpacking the manylinux_2_39 wheel (Python code only is used)"
  "$VENV/bin/python" -m pip install -q --no-compile --no-deps --only-binary=:all: \
    --platform manylinux_2_39_x86_64 --python-version "$pyver" --implementation cp \
    --target "$site" "$nvrx"
fi
# transformer_engine for Bridge's LoRA module only (tests/bridge/bridge_lora_without_te.py), at every
# interpreter start in this venv (torchrun's ranks included).
echo "import sys; sys.path.append('$PWD/tests/bridge'); import bridge_lora_without_te; bridge_lora_without_te.install()" \
  > "$site/_megatron_muon_bridge_env.pth"
rm -f "$VENV"/.installed-*
touch "$stamp"
echo "installed in ${SECONDS} s; $(du -sh "$VENV" | cut -f1) on disk"
