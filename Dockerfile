# The image of docker-compose.yml's consumer-kit services: the package with every extra (PostgreSQL,
# RabbitMQ, SQS, webhooks, CloudEvents, schedules, the coordinator server) and the example programs,
# which run from /app so that `examples.<name>` imports.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY consumer_kit ./consumer_kit
COPY sources ./sources
RUN pip install '.[all]'
COPY examples ./examples

# Not root: the workers need to write nothing but their logs.
RUN useradd --system --uid 10001 --no-create-home consumer-kit
USER consumer-kit
EXPOSE 8000 8080
CMD ["consumer-kit", "--help"]
