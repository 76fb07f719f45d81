#!/usr/bin/env bash
# Build what scripts/gpu_record_train.sh needs on a GPU machine that has PyTorch but no network:
#   DIR/site.tar.xz   the simulator, rosbag2 and training packages that machine's image lacks,
#                     as wheels for its Python (default 3.12), unpacked and pruned
#   DIR/gl/*.deb      the EGL / OpenGL loaders MuJoCo renders through (Debian amd64 packages)
#
#   scripts/gpu_carry.sh DIR [PYTHON_VERSION]
#
# Why a pruned archive and not the wheels: dm-control's wheel is 56 MB, almost all of it assets
# of domains the ALOHA tasks never load (locomotion walkers and soccer, the dog, test models);
# without them the archive is ~15 MB, so it travels with a working tree under a 64 MiB limit.
# The versions are this repository's pins (requirements*.txt), so the recording there is the
# recording here. PYTHON_VERSION 3.11 builds the same archive for this machine, which is how
# the script is tested without a GPU (README of scripts/: the dry run).
set -euo pipefail
DIR=${1:?usage: scripts/gpu_carry.sh DIR [PYTHON_VERSION]}
PYVER=${2:-3.12}
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-python3}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

# The pinned version of NAME in the repository's requirements files.
pin() {
  local v
  v=$(grep -h -i -E "^$1==" "$HERE"/requirements*.txt | head -1 | cut -d= -f3)
  [ -n "$v" ] || { echo "gpu_carry: no pin for $1 in requirements*.txt" >&2; exit 1; }
  echo "$1==$v"
}

# What the recorder and the trainer import beyond the image's own packages (torch, numpy,
# transformers' dependencies, scipy, pillow, pyyaml, tqdm, safetensors, absl-py, attrs, wrapt),
# with the dependencies of these that the image lacks. transformers travels too: the engine drives
# its decoder modules and is pinned to one version.
PINNED=(gym-aloha dm-control mujoco gymnasium rosbags lz4 transformers)
UNPINNED=(dm-env==1.6 dm-tree==0.1.10 PyOpenGL==3.1.10 Farama-Notifications==0.0.6 apsw==3.54.1.0
          backports.zstd==1.8.0 ruamel.yaml==0.19.1)
SPECS=()
for n in "${PINNED[@]}"; do SPECS+=("$(pin "$n")"); done
SPECS+=("${UNPINNED[@]}")

PLAT=(--python-version "$PYVER" --implementation cp --only-binary=:all:)
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  PLAT+=(--platform "$p")
done

mkdir -p "$DIR"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$WORK/wheels" "${SPECS[@]}"
"$PY" -m pip install -q --no-deps --no-compile "${PLAT[@]}" --target "$WORK/site" "$WORK"/wheels/*.whl
# Assets of domains the ALOHA tasks never load (nothing under them is imported on the way to a
# recording; checked with `python -X importtime`), and the wheels' console scripts.
rm -rf "$WORK"/site/dm_control/{locomotion,blender,suite/dog_assets,mujoco/testing,mjcf/test_assets,suite/all_domains.png} \
       "$WORK/site/bin"
tar -C "$WORK/site" -cf - . | xz -T0 -6 > "$DIR/site.tar.xz"

# MuJoCo's EGL context on an NVIDIA machine goes through glvnd: the loaders, not a driver.
# Package lists of its own (in $WORK), so the system's are not touched.
mkdir -p "$DIR/gl" "$WORK/lists/partial"
APT=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 "-oDir::State::Lists=$WORK/lists" -oAPT::Sandbox::User=root)
apt-get "${APT[@]}" update -qq >/dev/null
(cd "$DIR/gl" && rm -f ./*.deb && apt-get "${APT[@]}" download -qq libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2 >/dev/null)
du -sh "$DIR/site.tar.xz" "$DIR/gl"
