#!/usr/bin/env bash
# Creates or updates .venv with the package and its test extra, idempotently.
# The install is skipped when pyproject.toml and constraints.txt are unchanged since the last one
# (a stamp file keyed on their hash), so a second `make test` starts testing in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

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

stamp_key=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
stamp="$VENV/.installed-$stamp_key"
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ]; then
  exit 0
fi
py=$(find_python)
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV with $py"
  "$py" -m venv "$VENV"
fi
echo "installing megatron-muon[test] into $VENV (pinned by constraints.txt)"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -c constraints.txt -e ".[test]"
rm -f "$VENV"/.installed-*
touch "$stamp"
