"""structlog configuration shared by the operator and the agent: one line per event,
key=value (or JSON with ``KVGPU_LOG_FORMAT=json``), stdlib logging (Kopf's) routed through it."""

from __future__ import annotations

import logging
import os

import structlog


def configure_logging(level: str | None = None) -> None:
    lvl = getattr(logging, (level or os.environ.get("KVGPU_LOG_LEVEL", "INFO")).upper(), logging.INFO)
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if os.environ.get("KVGPU_LOG_FORMAT") == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    shared: list[structlog.types.Processor] = [
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler()
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(processors=[
        structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer], foreign_pre_chain=shared))
    handler.addFilter(quiet_kopf)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(lvl)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def quiet_kopf(record: logging.LogRecord) -> bool:
    """Kopf's routine lines, tuned down: "Handler '…' succeeded." (one per VGPUPool event,
    i.e. every status write) only at debug, and its "Request attempt #N failed; will retry"
    (the API server away, an expected fault it retries itself) as a warning, not an error."""
    if not record.name.startswith("kopf"):
        return True
    msg = record.getMessage()
    if record.levelno == logging.INFO and msg.startswith("Handler '") and msg.endswith("' succeeded."):
        return logging.getLogger().isEnabledFor(logging.DEBUG)
    if record.levelno == logging.ERROR and msg.startswith("Request attempt #") and "will retry" in msg:
        record.levelno, record.levelname = logging.WARNING, "WARNING"
    return True
