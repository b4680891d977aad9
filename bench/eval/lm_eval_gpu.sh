#!/usr/bin/env bash
# Issue #39's GPU point: lm-eval's `local-completions` against a stack on one GPU next to its `hf` model on the same
# weights, both bfloat16, on a random-weight checkpoint of the Llama-3.1-8B shape (bench/eval/lm_eval_parity.py).
#
#     python -m deepinfer.testing.random_model llama-8b --cache-dir .bench-models            # here: config + tokenizer
#     ROOTS="lm-eval tenacity pytz" bash bench/device_wheels.sh .whl-lmeval          # here: the harness's wheels
#     bash bench/eval/lm_eval_gpu.sh      # on the device, carrying .whl-stack, .whl-lmeval and .bench-models
#
# Writes the checkpoint's random bf16 weights (transformers' own initialisation, seed 0) next to the carried config,
# starts `deepinfer up` on it (one decode worker, no prefill worker, no store), runs the parity script, and leaves
# $OUT/lm-eval-gpu.{log,json}.
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device_env.sh
OUT=${OUT:-bench/results}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-lmeval .whl-lmeval/*.whl
export PYTHONPATH=$PYTHONPATH:/tmp/site-lmeval HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
python3 -c "import lm_eval, datasets, evaluate" || exit 3
model=/tmp/llama-8b
rm -rf "$model" && cp -r .bench-models/llama-8b "$model"
python3 - "$model" <<'PY' || exit 4
"""Random bf16 weights for the carried config, saved as safetensors beside it."""
import sys, time
import torch, transformers
started = time.perf_counter()
config = transformers.AutoConfig.from_pretrained(sys.argv[1])
torch.manual_seed(0)
with torch.device("cuda"):
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
model.save_pretrained(sys.argv[1])
print(f"random weights written in {time.perf_counter() - started:.0f} s", file=sys.stderr)
PY
export DEEPINFER_SERVED_MODEL_NAME=llama-8b-random DEEPINFER_DECODE_KV_CACHE_BYTES=8GiB \
    DEEPINFER_DECODE_MAX_MODEL_LEN=4096 DEEPINFER_DECODE_DTYPE=bfloat16
python3 -m deepinfer.cli up --model "$model" --device cuda --prefill 0 --kvcache 0 --port 8000 > "$OUT/lm-eval-gpu-stack.log" 2>&1 &
stack=$!
for _ in $(seq 240); do
    python3 - 2> /dev/null <<'PY' && break
"""Ready once a one-token completion is answered (the gateway lists the model before a worker has joined)."""
import json, urllib.request as u
body = json.dumps({"model": "llama-8b-random", "prompt": "Hi", "max_tokens": 1}).encode()
u.urlopen(u.Request("http://127.0.0.1:8000/v1/completions", body, {"Content-Type": "application/json"}), timeout=30)
PY
    kill -0 $stack 2> /dev/null || { echo "the stack exited"; tail -30 "$OUT/lm-eval-gpu-stack.log"; exit 5; }
    sleep 1
done
python3 bench/eval/lm_eval_parity.py --base-url http://127.0.0.1:8000 --model-dir "$model" \
    --served-model-name llama-8b-random --lm-eval /tmp/site-lmeval/bin/lm_eval --hf-dtype bfloat16 --hf-device cuda \
    --out /tmp/lm-eval-gpu 2> "$OUT/lm-eval-gpu.log" | tee "$OUT/lm-eval-gpu.json"
status=${PIPESTATUS[0]}
kill -INT $stack; wait $stack
exit $status
