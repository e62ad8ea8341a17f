"""Logs without the users' text. Prompts and outputs are logged only with --log-request-text;
this keeps them out of the other place they can reach a log: the message of an unexpected
exception, which may quote a request (a KeyError's key, a ValueError's input). Without the
flag, the gateway's own log of such an error and those of its servers' libraries (uvicorn's
"Exception in ASGI application", gRPC's "Unexpected ... raised by servicer method") show the
traceback and the exception's type, not its message."""
from __future__ import annotations

import logging
import traceback

LIBRARY_LOGGERS = ("uvicorn.error", "grpc._cython.cygrpc")


def withheld_traceback(exc: BaseException) -> str:
    return ("Traceback (most recent call last):\n"
            + "".join(traceback.format_tb(exc.__traceback__))
            + f"{type(exc).__name__}: (message withheld; --log-request-text shows it)")


def log_unexpected(log, exc: Exception, show_message: bool) -> None:
    if show_message:
        log.exception("unexpected error", exc_info=exc)
    else:
        log.error("unexpected error", error=type(exc).__name__,
                  traceback=withheld_traceback(exc))


class WithholdExceptionMessages(logging.Filter):
    """A record's traceback, formatted here without the exception's message (logging's
    Formatter uses exc_text as it is once set)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            record.exc_text = withheld_traceback(record.exc_info[1])
        return True


def withhold_library_exception_messages() -> None:
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, WithholdExceptionMessages) for f in logger.filters):
            logger.addFilter(WithholdExceptionMessages())
