#!/usr/bin/env bash
# A local Debian base image with Python, for building docker/Dockerfile where no image registry is reachable
# (`make base-image`; `make images` passes it as PYTHON_IMAGE and CUDA_IMAGE):
#
#     scripts/base_image.sh [TAG]        # default TAG: deepinfer/base:bookworm (needs root and debootstrap)
#
# debootstrap (minbase) of Debian 12 from the machine's Debian mirror, with python3, a virtual environment at
# /opt/venv first on PATH (pip installs there, as in the python:*-slim images' system Python), then
# `docker import`. Debian's python3 is 3.11, the version the slim and cpu images are built for.
set -euo pipefail
TAG=${1:-deepinfer/base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
command -v debootstrap > /dev/null || { echo "base_image.sh: no debootstrap (apt-get install debootstrap)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "base_image.sh: debootstrap needs root" >&2; exit 2; }
rootfs=$(mktemp -d /var/tmp/deepinfer-rootfs.XXXXXX)
chmod 755 "$rootfs"  # the image's root directory: mktemp makes it 0700, closed to the images' unprivileged user
trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" "$MIRROR"
chroot "$rootfs" python3 -m venv /opt/venv
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
tar -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$TAG"
docker image ls "$TAG"
