#!/usr/bin/env bash
# Creates or updates .venv with the package and its test extra, idempotently.
# The install is skipped when pyproject.toml and constraints.txt are unchanged since the last one
# (a stamp file keyed on their hash), so a second `make test` starts testing in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

source scripts/find_python.sh

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
