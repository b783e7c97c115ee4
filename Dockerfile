# One image for the simulator, the Locust master and its workers (docker-compose.yml).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Dependencies first, so a source change does not reinstall them.
COPY pyproject.toml README.md ./
COPY calculet_load ./calculet_load
COPY calculet_sim ./calculet_sim
COPY analysis ./analysis
# Editable: named mixes are read from configs/mixes/ next to the package, i.e. /app/configs.
RUN pip install -e .

COPY configs ./configs
COPY locustfiles ./locustfiles

# 8089 web UI, 5557 master <-> workers, 8000 the simulator
EXPOSE 8089 5557 8000
CMD ["locust", "--help"]
