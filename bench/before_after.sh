#!/usr/bin/env bash
# "No speed lost": the same benches on an earlier tree and on this one, in one device call, so both see the same
# lending of the same GPU (H200 lendings differ by up to 1.9x: compare within a run, never across runs).
#
#     rm -rf .before && mkdir .before && git archive BASE bench shared services | tar -x -C .before   # here
#     bash bench/before_after.sh [gpu] [serve]      # on the device, carrying .whl-stack and .before
#
# gpu:   bench/gpu.py --sections ceilings,prefill,decode (8B shape): prefill 4x4096, decode B=1/64/256 at 2k
# serve: bench/serve.py --random-model llama-1b --sweep 1,64,256 (service vs offline engine, 4 rounds)
# Each runs before, then after; logs and JSON under $OUT as before-*/after-*, and a table at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh
OUT=${OUT:-bench/results}
export PYTHONUNBUFFERED=1
sections=${*:-gpu serve}
run() {  # WHICH(before|after) NAME LIMIT_S SCRIPT ARGS...
    local which=$1 name=$2 limit=$3 tree=$PWD started=$SECONDS
    shift 3
    [ "$which" = before ] && tree=$PWD/.before
    (cd "$tree" && PYTHONPATH=/tmp/site:$tree/shared:$tree timeout "$limit" python3 "$@" \
        > "$OUT/$which-$name.log" 2>&1)
    echo "$which $name: rc $? in $((SECONDS - started)) s"
}
for section in $sections; do
    for which in before after; do
        case $section in
            gpu) run "$which" gpu 240 bench/gpu.py --sections ceilings,prefill,decode --out "$OUT/$which-gpu.json" ;;
            serve) run "$which" serve 240 bench/serve.py --device cuda --random-model llama-1b --sweep 1,64,256 \
                --max-tokens 256 --rounds 4 --out "$OUT/$which-serve.json" --log-dir "/tmp/$which-serve-logs" ;;
        esac
    done
done
python3 - "$OUT" <<'EOF'
"""before / after, side by side: prefill and decode tok/s (gpu.py), service/offline ratio per concurrency (serve.py)."""
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])


def load(name: str) -> dict:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


gpu = [load(f"{w}-gpu") for w in ("before", "after")]
serve = [{p["concurrency"]: p for p in load(f"{w}-serve").get("points", [])} for w in ("before", "after")]
rows = [("prefill 4x4096 tok/s", *(g.get("prefill", {}).get("ours_tok_s") for g in gpu))]
rows += [(f"decode B={b} tok/s", *(g.get("decode", {}).get(b, {}).get("graphs_tok_s") for g in gpu))
         for b in ("1", "64", "256")]
for c in sorted(set(serve[0]) | set(serve[1])):
    rows.append((f"serve c={c} service/offline", *(s.get(c, {}).get("service_over_offline") for s in serve)))
    rows.append((f"serve c={c} service tok/s", *(s.get(c, {}).get("service_output_tok_s") for s in serve)))
print(f"{'figure':32s} {'before':>12s} {'after':>12s} {'after/before':>12s}")
for name, before, after in rows:
    change = f"{after / before:.3f}" if before and after else ""
    print(f"{name:32s} {before!s:>12s} {after!s:>12s} {change:>12s}")
EOF
