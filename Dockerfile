# One image for the simulator, the Locust master and its workers (docker-compose.yml,
# deploy/kubernetes/). scripts/containers builds it and runs the stack.
#
# PYTHON_IMAGE: the base, any image with Python 3.11 and pip first on PATH (a site's
# own mirror of it, or the base `scripts/containers --base local` makes from Debian's
# packages where no registry is reachable).
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

# WHEELS: a folder of wheels to install from instead of the index. scripts/containers
# keeps one outside the clone, per pyproject.toml and Dockerfile, and mounts it there for
# the build (podman build --volume); a plain build downloads from the index.
ARG WHEELS=
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# The dependencies first, from pyproject.toml alone (pip installs them with an empty
# placeholder of the project and of its readme, both replaced below), so a change to the
# sources or the readme reinstalls none of them.
COPY pyproject.toml ./
RUN touch README.md \
 && pip install ${WHEELS:+--no-index --find-links $WHEELS} ".[native]"

COPY README.md ./
COPY calculet_load ./calculet_load
COPY calculet_sim ./calculet_sim
COPY analysis ./analysis
COPY calculet_drivers ./calculet_drivers
# Editable: named mixes are read from configs/mixes/ next to the package, i.e. /app/configs.
# Then the modules on a token event's path are compiled (calculet_load/measure/native.py:
# 17-32 % less CPU per request on a worker's I/O engine thread), and the native reader
# (calculet_load/measure/reader.c: plain sockets read and stamped in a thread of their
# own), with the `native` extra (mypy's mypyc, setuptools, installed above) and a C
# compiler installed for the build and removed after it. A build that fails fails the
# image: a worker never runs slower than documented without saying so.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && pip install --no-deps ${WHEELS:+--no-index --find-links $WHEELS} -e . \
 && python -c 'from calculet_load.measure import native; raise SystemExit(native.build())' \
 && apt-get purge -y --auto-remove gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

COPY configs ./configs
COPY locustfiles ./locustfiles

# 8089 web UI, 5557 master <-> workers, 8000 the simulator
EXPOSE 8089 5557 8000
CMD ["locust", "--help"]
