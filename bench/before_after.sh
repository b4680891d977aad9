#!/usr/bin/env bash
# "No speed lost": the same benches on an earlier tree and on this one, in one device call, so both see the same
# lending of the same GPU (H200 lendings differ by up to 1.9x: compare within a run, never across runs).
#
#     rm -rf .before && mkdir .before && git archive BASE bench shared services | tar -x -C .before   # here
#     bash bench/before_after.sh [gpu] [serve]      # on the device, carrying .whl-stack and .before
#
# gpu:   bench/gpu/gpu.py --sections ceilings,prefill,decode (8B shape): prefill 4x4096, decode B=1/64/256 at 2k
# serve: bench/serve/serve.py --random-model llama-1b --sweep 1,64,256 (service vs offline engine, 4 rounds)
# Each runs before, then after; logs and JSON under $OUT as before-*/after-*, and a table at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh
OUT=${OUT:-bench/results}
export PYTHONUNBUFFERED=1
sections=${*:-gpu serve}
run() {  # WHICH(before|after) NAME LIMIT_S SCRIPT ARGS...
    local which=$1 name=$2 limit=$3 tree=$PWD started=$SECONDS script
    shift 3
    [ "$which" = before ] && tree=$PWD/.before
    script=$1; shift
    # a tree from before bench/'s topic folders (issue #37) has the script at bench/NAME.py
    [ -f "$tree/$script" ] || script=bench/$(basename "$script")
    (cd "$tree" && PYTHONPATH=/tmp/site:$tree/shared:$tree timeout "$limit" python3 "$script" "$@" \
        > "$OUT/$which-$name.log" 2>&1)
    echo "$which $name: rc $? in $((SECONDS - started)) s"
}
for section in $sections; do
    for which in before after; do
        case $section in
            gpu) run "$which" gpu 240 bench/gpu/gpu.py --sections ceilings,prefill,decode --out "$OUT/$which-gpu.json" ;;
            serve) run "$which" serve 240 bench/serve/serve.py --device cuda --random-model llama-1b --sweep 1,64,256 \
                --max-tokens 256 --rounds 4 --out "$OUT/$which-serve.json" --log-dir "/tmp/$which-serve-logs" ;;
        esac
    done
done
# Side by side: every figure both runs have (serve.py's points by concurrency), `deepinfer bench compare`'s table.
for section in $sections; do
    [ -f "$OUT/before-$section.json" ] && [ -f "$OUT/after-$section.json" ] \
        && PYTHONPATH=/tmp/site:$PWD/shared python3 -m deepinfer.cli bench compare \
            "$OUT/before-$section.json" "$OUT/after-$section.json"
done
exit 0
