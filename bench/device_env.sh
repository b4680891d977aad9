# Sourced by the bench/gpu_*_runs.sh scripts on the GPU machine, from the repository root: installs the carried
# wheels (bench/device_wheels.sh makes them) and sets the environment the services and benches run in.
OUT=${OUT:-bench/results}
# once per set of wheels on this machine (a second source, e.g. a script that runs gpu_serve_runs.sh, skips it)
WHEELS_ID=$(ls .whl-stack | md5sum | cut -c1-32)
if [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$WHEELS_ID" ]; then
    python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl-stack/*.whl
    echo "$WHEELS_ID" > /tmp/site/.wheels
fi
export PYTHONPATH=/tmp/site:$PWD/shared:$PWD PATH=/tmp/site/bin:$PATH
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
