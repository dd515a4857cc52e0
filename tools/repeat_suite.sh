#!/usr/bin/env bash
# The suite's flake check: a fresh clone of this checkout runs CI's entry point once, then `make test` RUNS-1
# more times, then the test files in reverse order; one summary line per run in $SUMMARY. Run it alone on the
# machine: another job on the cores slows the engine's OpenMP steps several times and times requests out.
#   bash tools/repeat_suite.sh [RUNS=5] [CLONE=/tmp/suite-clone] [SUMMARY=/tmp/suite-runs.txt]
set -u
runs=${1:-5}; clone=${2:-/tmp/suite-clone}; summary=${3:-/tmp/suite-runs.txt}
src=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$clone" && git clone -q "$src" "$clone" && cd "$clone" || exit 1
git log --oneline -1 > "$summary"
for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  if [ "$i" = 1 ]; then CI=true bash .ci/run > "$clone/run$i.log" 2>&1; else CI=true make test > "$clone/run$i.log" 2>&1; fi
  echo "run $i rc=$? $(( $(date +%s) - start ))s: $(grep -E 'passed|failed' "$clone/run$i.log" | tail -1)" >> "$summary"
done
start=$(date +%s)
CI=true .venv/bin/python -m pytest -q $(ls tests/test_*.py | sort -r) > "$clone/reversed.log" 2>&1
echo "reversed file order rc=$? $(( $(date +%s) - start ))s: $(tail -1 "$clone/reversed.log")" >> "$summary"
