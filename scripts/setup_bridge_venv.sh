#!/usr/bin/env bash
# Creates .venv-bridge: megatron-muon[test] on constraints.txt's stack plus Megatron-Bridge pinned
# exactly (constraints-bridge.txt), for `make test-bridge` (docs/megatron_bridge.md).
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

source scripts/find_python.sh
# $PWD too: the .pth line below names this checkout's tests/bridge by its absolute path.
stamp_key=$( (cat pyproject.toml constraints.txt constraints-bridge.txt "$0"; echo "$PWD") | sha256sum | cut -c1-16)
stamp="$VENV/.installed-$stamp_key"
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ]; then
  exit 0
fi
py=$(find_python)
rm -rf "$VENV"
echo "creating $VENV with $py: megatron-muon[test] + Megatron-Bridge (constraints-bridge.txt)"
"$py" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q --no-compile -c constraints.txt -e ".[test]"
nvrx=$(grep -i '^nvidia-resiliency-ext==' constraints-bridge.txt)
grep -v -i -e '^#' -e '^$' -e '^nvidia-resiliency-ext==' constraints-bridge.txt > "$VENV/bridge-reqs.txt"
# The Bridge line is --no-deps (above); the rest are plain installs against constraints.txt's stack.
"$VENV/bin/python" -m pip install -q --no-compile --no-deps "$(grep -i '^megatron-bridge==' "$VENV/bridge-reqs.txt")"
"$VENV/bin/python" -m pip install -q --no-compile -c constraints.txt \
  $(grep -v -i '^megatron-bridge==' "$VENV/bridge-reqs.txt")
if ! "$VENV/bin/python" -m pip install -q --no-compile --no-deps --only-binary=:all: "$nvrx" 2>/dev/null; then
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  pyver=$("$VENV/bin/python" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
  echo "no $nvrx wheel for this glibc: unpacking the manylinux_2_39 wheel (Python code only is used)"
  "$VENV/bin/python" -m pip install -q --no-compile --no-deps --only-binary=:all: \
    --platform manylinux_2_39_x86_64 --python-version "$pyver" --implementation cp \
    --target "$site" "$nvrx"
fi
# transformer_engine for Bridge's LoRA module only (tests/bridge/bridge_lora_without_te.py), at every
# interpreter start in this venv (torchrun's ranks included).
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import sys; sys.path.append('$PWD/tests/bridge'); import bridge_lora_without_te; bridge_lora_without_te.install()" \
  > "$site/_megatron_muon_bridge_env.pth"
rm -f "$VENV"/.installed-*
touch "$stamp"
echo "installed in ${SECONDS} s; $(du -sh "$VENV" | cut -f1) on disk"
