#!/usr/bin/env bash
# Build the images of docker/Dockerfile on this machine (`make images`; `make image-cuda` for the CUDA one):
#
#     scripts/images.sh slim cpu [cuda]
#
# Tags: deepinfer/deepinfer[-cpu|-cuda]:VERSION (pyproject's version), the tags docker-compose.yml and the chart
# reference. Each build:
#   - resolves its packages here, with this machine's pip configuration (index, certificates, local wheels), into
#     .wheelhouse/ACCELERATOR (docker/install.sh with WHEELHOUSE set), then serves that directory on 127.0.0.1 and
#     builds with --network host, PIP_NO_INDEX=1 and PIP_FIND_LINKS pointing at it: pip in the build installs
#     exactly what pip here would, with no credentials or certificates copied into an image;
#   - starts from PYTHON_IMAGE / CUDA_IMAGE when set, else from the public images when they can be pulled, else from
#     a local Debian base (scripts/base_image.sh, made once);
#   - uses the running Docker engine, or a private one (scripts/dockerd.sh) when none answers.
# Build times and image sizes are printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
LOCAL_BASE=deepinfer/base:bookworm
docker version > /dev/null 2>&1 || eval "$(scripts/dockerd.sh start)"
export DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0}  # the classic builder: Debian's engine has no buildx plugin

tag_of() { case $1 in slim) echo "deepinfer/deepinfer:$VERSION" ;; *) echo "deepinfer/deepinfer-$1:$VERSION" ;; esac; }

base_or_local() {  # IMAGE: IMAGE if present or pullable, else the local Debian base (made once)
    if docker image inspect "$1" > /dev/null 2>&1 || timeout 60 docker pull -q "$1" > /dev/null 2>&1; then
        echo "$1"
        return
    fi
    docker image inspect "$LOCAL_BASE" > /dev/null 2>&1 || scripts/base_image.sh "$LOCAL_BASE" >&2
    echo "$LOCAL_BASE"
}

wheelhouse() {  # ACCELERATOR: .wheelhouse/ACCELERATOR filled by install.sh in download mode
    local dir=.wheelhouse/$1
    mkdir -p "$dir"
    # The CUDA image takes torch's CUDA build from the index: this machine's pip settings without its local wheel
    # directories (which may hold torch's CPU build, a higher version than the index's to pip: 2.13.0+cpu).
    if [ "$1" = cuda ]; then
        (
            unset PIP_FIND_LINKS
            eval "$(python3 -m pip config list | sed -n "s/^[a-z]*\.\([a-z-]*\)=\(.*\)$/\1 \2/p" \
                | grep -v '^find-links ' | while read -r key value; do
                    echo "export PIP_$(echo "$key" | tr 'a-z-' 'A-Z_')=$value"; done)"
            PIP_CONFIG_FILE=/dev/null WHEELHOUSE=$PWD/$dir sh docker/install.sh "$1"
        )
    else
        WHEELHOUSE=$PWD/$dir TORCH_CPU_INDEX= sh docker/install.sh "$1"
    fi
}

# Mooncake Transfer Engine in an image, as its user: off CUDA it starts over TCP on 127.0.0.1; the CUDA build links
# the driver's libcuda.so.1, which only the GPU runtime mounts, so there it is imported after torch with a stub of
# the driver's symbols (built with the image's gcc) in its place: every other library it links resolves.
transfer_engine_check() {  # ACCELERATOR
    local start='from deepinfer.dataplane.transfer_engine import TransferEngine as T; e = T.start()
print("transfer engine:", e.session_id, "over", e.protocol); e.close()'
    if [ "$1" != cuda ]; then
        docker run --rm --network host --entrypoint python3 "$(tag_of "$1")" -c "$start"
        return
    fi
    # shellcheck disable=SC2016  # expanded in the container
    docker run --rm --entrypoint sh "$(tag_of cuda)" -c 'set -e; cd /tmp
so=$(python3 -c "import mooncake, os; print(os.path.dirname(mooncake.__file__))")/engine.so
nm -D --undefined-only "$so" | awk "\$2 ~ /^cu[A-Z]/ {print \"void \" \$2 \"(void) {}\"}" > cuda_stub.c
mkdir stub && gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o stub/libcuda.so.1 cuda_stub.c
LD_LIBRARY_PATH=/tmp/stub python3 -c "import torch, mooncake.engine as m; m.TransferEngine()
print(\"transfer engine: imported after torch\", torch.__version__)"'
}

summary=()
for accelerator in "$@"; do
    started=$SECONDS
    wheelhouse "$accelerator"
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    python3 -m http.server --bind 127.0.0.1 --directory ".wheelhouse/$accelerator" "$port" > /dev/null 2>&1 &
    server=$!
    python_image=${PYTHON_IMAGE:-$(base_or_local python:3.11.14-slim-bookworm)}
    # The classic builder pulls every stage's base: the stages not built get one that is already here.
    cuda_image=$python_image cann_image=$python_image
    [ "$accelerator" = cuda ] && cuda_image=${CUDA_IMAGE:-$(base_or_local nvidia/cuda:13.0.0-runtime-ubuntu24.04)}
    replaced=$(docker image inspect -f '{{.Id}}' "$(tag_of "$accelerator")" 2> /dev/null || true)
    status=0
    docker build --network host -f docker/Dockerfile -t "$(tag_of "$accelerator")" \
        --build-arg ACCELERATOR="$accelerator" --build-arg PYTHON_IMAGE="$python_image" \
        --build-arg CUDA_IMAGE="$cuda_image" --build-arg CANN_IMAGE="$cann_image" --build-arg PIP_NO_INDEX=1 \
        --build-arg PIP_FIND_LINKS="http://127.0.0.1:$port/" . || status=$?
    kill "$server"
    [ "$status" = 0 ] || exit "$status"
    if [ "$accelerator" = cuda ]; then  # torch's CUDA build, not a CPU wheel that pip preferred
        docker run --rm --entrypoint python3 "$(tag_of cuda)" -c \
            'import torch; assert torch.version.cuda, torch.__version__; print("torch", torch.__version__)'
    fi
    transfer_engine_check "$accelerator"
    # The image this build replaced, now untagged: removed, or rebuilds fill the disk (the vfs driver of
    # scripts/dockerd.sh keeps a full copy of every layer); left where a container still uses it.
    if [ -n "$replaced" ] && [ "$replaced" != "$(docker image inspect -f '{{.Id}}' "$(tag_of "$accelerator")")" ]; then
        docker image rm "$replaced" > /dev/null 2>&1 || true
    fi
    size=$(docker image inspect -f '{{.Size}}' "$(tag_of "$accelerator")")
    summary+=("$(tag_of "$accelerator"): $((size / 1000000)) MB, built in $((SECONDS - started)) s")
done
printf '%s\n' "${summary[@]}"
