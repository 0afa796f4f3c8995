#!/usr/bin/env bash
# The server's dependencies that ../shared/device/prepare.sh's .device/whl does not hold (the state store's
# SQLAlchemy and aiosqlite, Alembic, the Files API's python-multipart, NVML's nvidia-ml-py), as wheels in .device/whl2, at the versions
# this checkout's .venv runs. Here, once: `bash perf/gpu/extra_wheels.sh`. There: call 1 carries .device/whl2 (a warm
# machine keeps it for call 2; call 2's carry has no room left beside the CUDA part), and issue45.sh installs it
# into /tmp/site after .device/setup-cuda.sh.
set -euo pipefail
mkdir -p .device/whl2
pins=$(.venv/bin/python -m pip list --format freeze 2>/dev/null | grep -iE '^(sqlalchemy|greenlet|aiosqlite|alembic|mako|python-multipart|nvidia-ml-py)==')
# shellcheck disable=SC2086
.venv/bin/python -m pip download -q --only-binary :all: --no-deps --python-version 3.12 --platform manylinux_2_28_x86_64 \
  -d .device/whl2 $pins
ls .device/whl2
