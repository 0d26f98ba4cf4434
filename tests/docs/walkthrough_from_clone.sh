#!/usr/bin/env bash
# The walk-through followed from a fresh clone (`make walkthrough`): clone this repository's
# HEAD into an empty directory, install it with exactly the commands of docs/index.md
# "Install", then run every command of docs/walkthrough.md, in order, in an empty directory
# of its own with that environment active (tests/docs/snippets.py runs them as the test suite
# does). Exits non-zero, printing the page's transcript, unless every row arrives once.
set -euo pipefail
source_repo="$(cd "$(dirname "$0")/../.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
git clone --quiet "$source_repo" "$work/millpond"
cd "$work/millpond"
python3 -m venv .venv && . .venv/bin/activate
pip install --quiet -e '.[spark,postgres,local]'
mkdir "$work/reader"
python - "$work/reader" <<'PY'
import sys
from pathlib import Path

from tests.docs.snippets import reader_environment, run_page

run = run_page(
    "walkthrough.md",
    reader_environment(),
    Path(sys.argv[1]),
    timeout=900,
    on_exit='[ -z "${MILLPOND_LOCAL_PID:-}" ] || kill "$MILLPOND_LOCAL_PID" 2>/dev/null || true',
)
print(run.output)
counted = " 200000 | 200000" in run.output  # rows | distinct ids, as the page's last query prints
if run.returncode != 0 or not counted:
    sys.exit(f"the walk-through failed from a fresh clone: {run.failure()}")
print("walk-through from a fresh clone: 200,000 rows, each once")
PY
