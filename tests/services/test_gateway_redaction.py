"""Without --log-request-text, an unexpected exception reaches the logs with its traceback and
type but not its message, which may quote a request: in the gateway's own log line and in the
lines of uvicorn's and gRPC's loggers."""
from __future__ import annotations

import logging

import structlog

from kvrelay.gateway.redaction import (LIBRARY_LOGGERS, WithholdExceptionMessages,
                                        log_unexpected, withhold_library_exception_messages)

SECRET = "prompt text Quokka"


def _raised() -> Exception:
    try:
        {}[SECRET]
    except KeyError as exc:
        return exc


def test_library_loggers_withhold_the_message():
    exc = _raised()
    record = logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1,
                               "Exception in ASGI application", None,
                               (type(exc), exc, exc.__traceback__))
    assert WithholdExceptionMessages().filter(record)
    text = logging.Formatter("%(message)s").format(record)
    assert "Exception in ASGI application" in text and "_raised" in text
    assert "KeyError: (message withheld" in text and SECRET not in text
    withhold_library_exception_messages()
    withhold_library_exception_messages()  # once per logger, however often it is called
    for name in LIBRARY_LOGGERS:
        filters = [f for f in logging.getLogger(name).filters
                   if isinstance(f, WithholdExceptionMessages)]
        assert len(filters) == 1, name


def test_the_gateway_logs_the_message_only_when_asked():
    log = structlog.get_logger("test")
    with structlog.testing.capture_logs() as lines:
        log_unexpected(log, _raised(), show_message=False)
    assert lines[0]["error"] == "KeyError" and "_raised" in lines[0]["traceback"]
    assert SECRET not in repr(lines)
    with structlog.testing.capture_logs() as lines:
        log_unexpected(log, _raised(), show_message=True)
    assert lines[0]["exc_info"].args == (SECRET,)
