#!/usr/bin/env bash
# The serving runs of one device session, as run on the GPU machine (see bench/device_wheels.sh for the
# wheels it installs first). Each variant: bench/serve/serve.py under a time limit, its JSON and log under $OUT.
#
#     bench/serve/gpu_serve_runs.sh VARIANT...      # VARIANT: default | default-async | default8b[64] | split | aggregated |
#         *-gil | split8b | aggregated8b | trace64 | nostore64 | sync64 | hosttier
#         | default64 (c=64 with offline) | prof64 (py-spy of the decode worker at c=64) | offgc (offline c=64 without/with gc.freeze) | offprof64 (py-spy of offgc, one repeat)
#         | nohost64-N (c=64, host tier off) | pin1-N / pin2-N / base-N (sweep 1,64,256, no offline: the decode
#         worker's threads on one core / two cores / unpinned) | mbt512-N / mbt8k-N (c=256, max_num_batched_tokens 512 / 8192)
#         | trace1 (c=1 traced; bench/serve/trace_ttft.py: the first token's path) | gw8-N / sched2-N (c=64 and 256 with 8 gateway processes / 2 schedulers)
#         | prof1 (py-spy of the decode worker at c=1) | c1-N / nostore1-N / nohost1-N (c=1 only, no offline: store tier
#         off / host tier off) | pw-N / nopw-N (sweep 1,64,256, no offline: prompt-step graphs on / off)
#         | onek-N (as pw-N with mixed steps' attention in one kernel: mixed_step_decode_kernel off; A/B with pw-N)
#         | pw64-N / onek64-N / winM-N (sweep 64,256, no offline: as pw-N / onek-N / with admission_window_s = M ms)
#         | nogs64-N (as pw64-N with graph_sampling off: the decode graphs end at the hidden states; A/B with pw64-N)
#         | nofull64-N (as pw64-N with execution_mode piecewise: prompt steps as piecewise graphs; A/B with pw64-N)
#         | temp64-N (as pw64-N at temperature 0.7, with offline: every step through the sampler and its row keys)
#         | egilU-N (as pw64-N, the decode worker's switch interval U µs while a prefill or mixed step launches)
#         | mixedstep (bench/gpu/mixed_step.py: eager / piecewise / one attention kernel per mixed step)
#         | mixedprof (py-spy of bench/gpu/mixed_step.py at 64 decode rows + a 32-token prompt, summarised; MIXEDPROF_VARIANTS: its columns, default full)
#         | handoff (bench/serve/gil_handoff.py on the host's CPU) | gil64-N / gil05-N (the decode worker's switch interval 0.1 / 0.5 ms)
#         | default64-N | hosttier64-N | wgen64-N (c=64 only, no offline: interleave them for an A/B, e.g.
#         default64-1 hosttier64-1 wgen64-1 default64-2 ...; wgen: host tier + decode writes generated blocks)
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device_env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
# Fail in a second, not after a start timeout, when the carried wheels miss something the services import.
python3 -c "import services.gateway.main, services.decode.main, services.prefill.main, services.scheduler.main" || exit 1
run() {  # NAME LIMIT_S ARGS...
    local name=$1 limit=$2; shift 2
    local started=$SECONDS
    # 8 rounds: a c=64 window of ~6 s (4 rounds gave ~3 s and +-15% between runs of one build)
    timeout "$limit" python3 bench/serve/serve.py --device cuda --max-tokens 256 --rounds 8 --out "$OUT/$name.json" \
        --log-dir "/tmp/$name-logs" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: rc $? in $((SECONDS - started)) s"
    # Triton compiles on a request's path (deepinfer.kernels.compile_watch): each one is a stalled step.
    grep -h "Triton compiled" /tmp/"$name"-logs/*.log 2>/dev/null | cut -c1-300 | tee "$OUT/$name-compiles.log" | head -5
    grep -A6 "^service vs offline" "$OUT/$name.log" || tail -5 "$OUT/$name.log"
}
profile_decode() {  # NAME [CONCURRENCY]: py-spy (its wheel put in .whl-stack by hand: pip download py-spy) samples the decode worker for 5 s of the measured load
    local name=$1 concurrency=${2:-64} pid
    until grep -q "concurrency $concurrency: measured load starts" "$OUT/$name.log" 2>/dev/null; do sleep 0.5; done
    sleep 3  # the client processes start (~2 s on the H200 host)
    pid=$(pgrep -f "services.decode" | head -1)
    py-spy record --pid "$pid" --duration 5 --rate 1000 --threads --idle --nonblocking --format raw \
        --output "$OUT/$name-pyspy.txt" > "$OUT/$name-pyspy.log" 2>&1
    summarize_profile "$name"
}
summarize_profile() {  # NAME [MATCH]: the raw profile is tens of MB; its per-thread summary a few KB
    python3 -m deepinfer.bench.pyspy_summary "$OUT/$1-pyspy.txt" ${2:+--match "$2"} > "$OUT/$1-pyspy-summary.txt"
    gzip -f "$OUT/$1-pyspy.txt"
}
pin_decode() {  # NAME CPUS: every thread of the decode worker on CPUS (taskset) once its load starts
    local name=$1 cpus=$2 pid
    until grep -q "measured load starts" "$OUT/$name.log" 2>/dev/null; do sleep 0.2; done
    pid=$(pgrep -f "services.decode" | head -1)
    taskset -a -p -c "$cpus" "$pid" > "$OUT/$name-taskset.log" 2>&1
}
for variant in "$@"; do
    case $variant in
        default) run default 300 --random-model llama-1b --sweep 1,64,256 ;;
        default-async) run default-async 200 --random-model llama-1b --sweep 1,64,256 --no-offline \
            --env DEEPINFER_DECODE_ASYNC_SCHEDULING=true ;;
        default8b) run default8b 300 --random-model llama-8b --sweep 1,64 ;;
        default8b64) run default8b64 200 --random-model llama-8b --sweep 64 ;;
        default2gpu) run default2gpu 200 --random-model llama-1b --sweep 1,64 ;;  # on 2 GPUs: prefill 0, decode 1
        split) run split 330 --random-model llama-1b --sweep 1,64,256 ;;
        aggregated) run aggregated 230 --random-model llama-1b --sweep 1,64,256 --prefill 0 ;;
        aggregated-gil) run aggregated-gil 200 --random-model llama-1b --sweep 1,64,256 --prefill 0 --no-offline \
            --env DEEPINFER_DECODE_GIL_SWITCH_INTERVAL_S=0.0005 ;;
        split-gil) run split-gil 200 --random-model llama-1b --sweep 1,64,256 --no-offline \
            --env DEEPINFER_DECODE_GIL_SWITCH_INTERVAL_S=0.0005 --env DEEPINFER_PREFILL_GIL_SWITCH_INTERVAL_S=0.0005 ;;
        split8b) run split8b 300 --random-model llama-8b --sweep 1,64 ;;
        aggregated8b) run aggregated8b 200 --random-model llama-8b --sweep 1,64 --prefill 0 --no-offline ;;
        trace1) run trace1 100 --random-model llama-1b --sweep 1 --no-offline --trace
            python3 bench/serve/trace_ttft.py /tmp/trace1-logs/traces --out "$OUT/trace1-ttft.json" | tee "$OUT/trace1-ttft.log" ;;
        trace64) run trace64 150 --random-model llama-1b --sweep 64 --no-offline --trace
            python3 bench/serve/trace_ttft.py /tmp/trace64-logs/traces --out "$OUT/trace64-ttft.json" | tee "$OUT/trace64-ttft.log" ;;
        nostore64) run nostore64 150 --random-model llama-1b --sweep 64 --no-offline --env DEEPINFER_DECODE_KV_STORE=false ;;
        sync64) run sync64 150 --random-model llama-1b --sweep 1,64 --no-offline --env DEEPINFER_DECODE_ASYNC_SCHEDULING=false ;;
        default64-*) run "$variant" 120 --random-model llama-1b --sweep 64 --no-offline ;;
        hosttier64-*) run "$variant" 120 --random-model llama-1b --sweep 64 --no-offline \
            --env DEEPINFER_DECODE_KV_HOST_CACHE_BYTES=8GiB ;;
        wgen64-*) run "$variant" 120 --random-model llama-1b --sweep 64 --no-offline \
            --env DEEPINFER_DECODE_KV_HOST_CACHE_BYTES=8GiB --env DEEPINFER_DECODE_KV_STORE_WRITE_GENERATED=true ;;
        default64) run default64 150 --random-model llama-1b --sweep 64 ;;
        gil64-*) run "$variant" 120 --random-model llama-1b --sweep 64 --no-offline \
            --env DEEPINFER_DECODE_GIL_SWITCH_INTERVAL_S=0.0001 ;;
        gil05-*) run "$variant" 120 --random-model llama-1b --sweep 64 --no-offline \
            --env DEEPINFER_DECODE_GIL_SWITCH_INTERVAL_S=0.0005 ;;
        prof64) profile_decode prof64 & run prof64 150 --random-model llama-1b --sweep 64 --no-offline --rounds 24; wait ;;
        prof1) profile_decode prof1 1 & run prof1 120 --random-model llama-1b --sweep 1 --no-offline --rounds 32; wait ;;
        c1-*) run "$variant" 100 --random-model llama-1b --sweep 1 --no-offline ;;
        pw-*) run "$variant" 200 --random-model llama-1b --sweep 1,64,256 --no-offline ;;
        nopw-*) run "$variant" 200 --random-model llama-1b --sweep 1,64,256 --no-offline --decode-graphs-only ;;
        pw64-*) run "$variant" 150 --random-model llama-1b --sweep 64,256 --no-offline ;;
        nogs64-*) run "$variant" 150 --random-model llama-1b --sweep 64,256 --no-offline --no-graph-sampling ;;
        nofull64-*) run "$variant" 150 --random-model llama-1b --sweep 64,256 --no-offline --piecewise-graphs ;;
        temp64-*) run "$variant" 200 --random-model llama-1b --sweep 64,256 --temperature 0.7 ;;
        onek64-*) run "$variant" 150 --random-model llama-1b --sweep 64,256 --no-offline --one-attention-kernel ;;
        win*-*) ms=${variant#win}; ms=${ms%%-*}
            run "$variant" 150 --random-model llama-1b --sweep 64,256 --no-offline \
                --env DEEPINFER_DECODE_ADMISSION_WINDOW_S="$(python3 -c "print($ms / 1000)")" ;;
        egil*-*) us=${variant#egil}; us=${us%%-*}
            run "$variant" 150 --random-model llama-1b --sweep 64,256 --no-offline \
                --env DEEPINFER_DECODE_EAGER_STEP_SWITCH_INTERVAL_S="$(python3 -c "print($us / 1e6)")" ;;
        onek-*) run "$variant" 200 --random-model llama-1b --sweep 1,64,256 --no-offline --one-attention-kernel ;;
        mixedprof) timeout 150 py-spy record --rate 1000 --nonblocking --threads --format raw --output "$OUT/mixedprof-pyspy.txt" \
            -- python3 bench/gpu/mixed_step.py --random-model llama-1b --decode-rows 64 --prompt-tokens 32 --steps 400 \
            --context 300 --variants ${MIXEDPROF_VARIANTS:-full} > "$OUT/mixedprof.log" 2>&1; echo "mixedprof: rc $?"; summarize_profile mixedprof step_ms
            head -30 "$OUT/mixedprof-pyspy-summary.txt" ;;
        mixedstep) timeout 300 python3 bench/gpu/mixed_step.py --random-model llama-1b --out "$OUT/mixedstep.json" \
            > "$OUT/mixedstep.log" 2>&1; echo "mixedstep: rc $?"; cat "$OUT/mixedstep.log" | head -12 ;;
        nostore1-*) run "$variant" 100 --random-model llama-1b --sweep 1 --no-offline --env DEEPINFER_DECODE_KV_STORE=false ;;
        nohost1-*) run "$variant" 100 --random-model llama-1b --sweep 1 --no-offline --env DEEPINFER_DECODE_KV_HOST_CACHE_BYTES=0 ;;
        offgc) timeout 300 python3 bench/serve/offline_gc.py --random-model llama-1b --device cuda --repeats 3 \
            --out "$OUT/offgc.json" > "$OUT/offgc.log" 2>&1; echo "offgc: rc $?"; tail -3 "$OUT/offgc.log" ;;
        offprof64) py-spy record --rate 1000 --threads --idle --nonblocking --format raw --output "$OUT/offprof64-pyspy.txt" \
            -- python3 bench/serve/offline_gc.py --random-model llama-1b --device cuda --repeats 1 > "$OUT/offprof64.log" 2>&1
            echo "offprof64: rc $?"; tail -3 "$OUT/offprof64.log"; summarize_profile offprof64 ;;
        nohost64-*) run "$variant" 120 --random-model llama-1b --sweep 64 --no-offline --env DEEPINFER_DECODE_KV_HOST_CACHE_BYTES=0 ;;
        pin1-*) pin_decode "$variant" 3 & run "$variant" 200 --random-model llama-1b --sweep 1,64,256 --no-offline; wait ;;
        pin2-*) pin_decode "$variant" 3,4 & run "$variant" 200 --random-model llama-1b --sweep 1,64,256 --no-offline; wait ;;
        base-*) run "$variant" 200 --random-model llama-1b --sweep 1,64,256 --no-offline ;;
        mbt512-*) run "$variant" 120 --random-model llama-1b --sweep 256 --no-offline --env DEEPINFER_DECODE_MAX_NUM_BATCHED_TOKENS=512 ;;
        mbt8k-*) run "$variant" 120 --random-model llama-1b --sweep 256 --no-offline --env DEEPINFER_DECODE_MAX_NUM_BATCHED_TOKENS=8192 ;;
        gw8-*) run "$variant" 150 --random-model llama-1b --sweep 64,256 --no-offline --gateways 8 ;;
        sched2-*) run "$variant" 150 --random-model llama-1b --sweep 64,256 --no-offline --schedulers 2 ;;
        handoff) python3 bench/serve/gil_handoff.py --cpu 3 --out "$OUT/handoff.json" > "$OUT/handoff.log" 2>&1; tail -6 "$OUT/handoff.log" ;;
        hosttier) run hosttier 200 --random-model llama-1b --sweep 1,64,256 --no-offline \
            --env DEEPINFER_DECODE_KV_HOST_CACHE_BYTES=8GiB ;;
        *) echo "unknown variant $variant" >&2 ;;
    esac
done
