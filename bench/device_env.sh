# Sourced by the bench/gpu_*_runs.sh scripts on the GPU machine, from the repository root: installs the carried
# wheels (bench/device_wheels.sh makes them) and sets the environment the services and benches run in.
OUT=${OUT:-bench/results}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-stack/*.whl
export PYTHONPATH=/tmp/site:$PWD/shared:$PWD PATH=/tmp/site/bin:$PATH
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
