#!/usr/bin/env bash
# The KV-tier runs of one device session (issue #12), as run on the GPU machine: the host tier's GPU tests, its
# copy GB/s against a pinned copy_, and bench/kv/kv_tiers.py on the llama-8b shape. Results under $OUT.
#
#     bench/kv/gpu_tier_runs.sh STEP...   # STEP: tests | copy | ttft | multiturn | shm-tests | shm-copy | shm-ttft
#                                                    | shm-ttft-plane
# The shm-* steps are issue 31's node-local path: the DMA path's GPU tests, its copy GB/s against a pinned copy_,
# TTFT from the store through shared memory (DMA) beside recompute (shm-ttft), and the host tier and the store over
# the data plane (shm-ttft-plane; two stacks' runs do not fit one 10-minute call), each load path forced (":load")
# and the chooser's pick (":measured").
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device_env.sh
step() {  # NAME LIMIT_S COMMAND...
    local name=$1 limit=$2; shift 2
    local started=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: rc $? in $((SECONDS - started)) s"
    tail -25 "$OUT/$name.log"
}
tiers() {  # NAME LIMIT_S ARGS...
    local name=$1 limit=$2; shift 2
    step "$name" "$limit" python3 bench/kv/kv_tiers.py --random-model llama-8b --cache-dir .bench-models --device cuda \
        --out "$OUT/$name.json" "$@"
}
for s in "$@"; do
    case $s in
        tests) step gpu-tests 120 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_host_tier_gpu.py ;;
        copy) step host-tier-copy 90 python3 bench/kv/host_tier_copy.py --out "$OUT/host-tier-copy.json" ;;
        ttft) tiers kv-tiers-ttft 450 --modes recompute,host,store --prompts 2 ;;
        multiturn) tiers kv-tiers-multiturn 200 --modes tiers-off,tiers-on --mt-pool-tokens 16384 ;;
        shm-tests) step gpu-shm-tests 150 python3 -m pytest -q -rs -p no:cacheprovider \
            tests/gpu/test_store_shm_dma_gpu.py tests/gpu/test_store_load_gpu.py ;;
        shm-copy) df -h /dev/shm; step kv-shm-copy 150 python3 bench/kv/kv_shm.py --device cuda --blocks 256 --reps 10 \
            --out "$OUT/kv-shm-cuda.json" ;;
        shm-ttft) df -h /dev/shm; tiers kv-tiers-shm 570 --prompts 2 \
            --modes recompute,store-shm:load,store-shm:measured ;;
        shm-ttft-plane) tiers kv-tiers-plane 570 --prompts 2 --modes host:load,store:load,store:measured ;;
        *) echo "unknown step $s" >&2 ;;
    esac
done
