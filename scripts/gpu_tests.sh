#!/usr/bin/env bash
# All of tests/gpu in one call on a GPU machine, with its log and counts:
#
#     GIT_COMMIT=$(git rev-parse --short HEAD) [SHARD=1/3] bash scripts/gpu_tests.sh [PYTEST_ARGS...]   # on the device
#
# Installs the carried wheels once (bench/device_wheels.sh makes .whl-stack here; the device call carries it), runs
# `pytest tests/gpu --noconftest`, and writes under $OUT (default bench/results, git-ignored):
#   gpu-tests.log   pytest's output          gpu-tests.xml   its JUnit report
#   gpu-tests.json  {date, commit, device, passed, failed, errors, skipped, seconds, failures: [test ids]}
# Exit status: pytest's. Commit the log (as docs/gpu-tests/gpu-tests-<date>-<commit>.log) and the counts
# (docs/gpu-tests.md) of every run that closes an engine, kernel or worker change.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
source bench/device_env.sh
export PYTHONUNBUFFERED=1
commit=${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
# SHARD=i/n runs the i-th of n shares of the test files (every n-th file, by name, from the i-th): the whole suite
# took over 600 s on one H200 on 2026-12-04, more than one device call, so it runs in thirds (SHARD=1/3, 2/3, 3/3;
# the largest took 272 s on 2026-12-05).
files=(tests/gpu)
if [ -n "${SHARD:-}" ]; then
    index=${SHARD%/*} count=${SHARD#*/} files=()
    mapfile -t all < <(ls tests/gpu/test_*.py | sort)
    for i in "${!all[@]}"; do
        [ $(( i % count )) -eq $(( index - 1 )) ] && files+=("${all[$i]}")
    done
    commit="$commit shard $SHARD"
fi
started=$SECONDS
python3 -m pytest "${files[@]}" -q --noconftest -rfEs -p no:cacheprovider --junitxml "$OUT/gpu-tests.xml" "$@" \
    2>&1 | tee "$OUT/gpu-tests.log"
status=${PIPESTATUS[0]}
python3 - "$OUT/gpu-tests.xml" "$commit" "$((SECONDS - started))" > "$OUT/gpu-tests.json" <<'EOF'
"""Counts of a JUnit report, with the run's commit, date and device, as one JSON object."""

import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

path, commit, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3])
cases = ET.parse(path).getroot().iter("testcase")
counts, failures = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}, []
for case in cases:
    test_id = f"{case.get('classname')}::{case.get('name')}"
    if case.find("failure") is not None:
        counts["failed"] += 1
        failures.append(test_id)
    elif case.find("error") is not None:
        counts["errors"] += 1
        failures.append(test_id)
    elif case.find("skipped") is not None:
        counts["skipped"] += 1
    else:
        counts["passed"] += 1
device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                        text=True).stdout.strip().replace("\n", " + ") or "no GPU"
print(json.dumps({"date": time.strftime("%Y-%m-%d"), "commit": commit, "device": device, **counts,
                  "seconds": seconds, "failures": failures}, indent=1))
EOF
cat "$OUT/gpu-tests.json"
exit "$status"
