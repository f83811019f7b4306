#!/usr/bin/env bash
# The oldest supported stack, installed as a Megatron container holds it (CI's second run):
#  1. a fresh venv (.venv-oldest) gets the oldest supported torch first (constraints-oldest.txt),
#  2. `pip install -e .[test]` with the other lower bounds must keep that torch (pyproject.toml
#     declares ranges, not pins), and a `pip install .` (not editable) would keep it too,
#  3. the single-process tests (-m "not multirank") and one 2-rank factory parity test run there.
# PyPI's Linux torch is the CUDA build (with its nvidia-* wheels; it runs on CPU without a GPU):
# download.pytorch.org's CPU-only wheels are not reachable from every machine CI runs on.
# TORCH_VERSION=X installs that torch instead (any version in pyproject's range must be kept too).
# The install is skipped when the venv was built from the same files (a stamp file).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV_OLDEST:-.venv-oldest}
PARITY_TEST=tests/test_factory.py::test_moe_gpt_routes_experts_to_the_expert_muon_and_matches_reference

source scripts/find_python.sh
torch_version=${TORCH_VERSION:-$(sed -n 's/^torch==//p' constraints-oldest.txt)}
stamp_key=$(echo "$torch_version" | cat - pyproject.toml constraints-oldest.txt "$0" | sha256sum | cut -c1-16)
stamp="$VENV/.installed-$stamp_key"
if [ ! -f "$stamp" ]; then
  py=$(find_python)
  rm -rf "$VENV"
  echo "creating $VENV with $py: torch $torch_version first, then megatron-muon[test]"
  "$py" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # pip writes the .pyc files (about 40 s on 2 cores): where PYTHONDONTWRITEBYTECODE is set, as on
  # CI's machines, Python never writes them, and every process of the tests would compile torch
  # and megatron again (importing megatron.training: 20 s without them, 12 s with them).
  "$VENV/bin/python" -m pip install -q "torch==$torch_version"
  "$VENV/bin/python" -m pip install -q -e ".[test]" \
    -c <(grep -v '^torch==' constraints-oldest.txt)
  installed=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
  if [ "${installed%%+*}" != "$torch_version" ]; then
    echo "error: pip install -e .[test] replaced torch $torch_version by $installed" >&2
    exit 1
  fi
  "$VENV/bin/python" -m pip install -q --dry-run --report "$VENV/report.json" .
  "$VENV/bin/python" - "$VENV/report.json" <<'PY'
import json, sys
would_install = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                 for item in json.load(open(sys.argv[1]))["install"]}
if "torch" in would_install:
    sys.exit(f"error: pip install . would replace the installed torch by {would_install['torch']}")
print(f"pip install . keeps torch; it would install only {sorted(would_install)}")
PY
  touch "$stamp"
  echo "installed in ${SECONDS} s"
fi
"$VENV/bin/python" -c 'import torch, megatron.core.package_info as m; print(f"oldest stack: torch {torch.__version__}, megatron-core {m.__version__}")' 2>/dev/null
"$VENV/bin/python" -m pytest tests -m "not multirank" -q -p no:cacheprovider
"$VENV/bin/python" -m pytest "$PARITY_TEST" -q -p no:cacheprovider
echo "oldest-stack run: ${SECONDS} s"
