# Sourced by the venv scripts: find_python prints a Python >= 3.12 (megatron-core 0.19 requires it):
# $PYTHON if set, else a python3.12 on PATH that runs, else the newest pyenv 3.12+.
find_python() {
  if [ -n "${PYTHON:-}" ]; then
    "$PYTHON" -c 'import sys; assert sys.version_info[:2] >= (3, 12)' 2>/dev/null && { echo "$PYTHON"; return; }
    echo "error: PYTHON=$PYTHON is not a working Python >= 3.12" >&2; return 1
  fi
  if python3.12 -c 'pass' >/dev/null 2>&1; then command -v python3.12; return; fi
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-9]' | sort -V); do
      p=$(PYENV_VERSION=$v pyenv which python3 2>/dev/null) && "$p" -c 'pass' 2>/dev/null && { echo "$p"; return; }
    done
  fi
  echo "error: Python 3.12 (or newer) is needed (megatron-core 0.19 requires it) and none was found." >&2
  echo "       Install it, or point at one: make test PYTHON=/path/to/python3.12" >&2
  return 1
}
