"""File names made safe for one line of a log or a table.

A POSIX file name may hold any byte but `/` and NUL: newlines (which would
forge log lines and split table rows), terminal escapes, and bytes that are
not UTF-8 (which Python carries as surrogate escapes, and which a UTF-8 log
file cannot encode). Human-facing output shows such names with backslash
escapes; JSON output keeps them exact.
"""

from __future__ import annotations

import logging


def printable(text: str) -> str:
    """`text` with control characters, backslashes and undecodable bytes as
    backslash escapes (`\\n`, `\\\\`, `\\xff`, `\\u2028`); printable text unchanged."""
    if text.isprintable() and "\\" not in text:
        return text
    out = []
    for ch in text:
        o = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif 0xDC80 <= o <= 0xDCFF:  # a byte that was not UTF-8 (os.fsdecode's surrogateescape)
            out.append(f"\\x{o - 0xDC00:02x}")
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape", "backslashreplace").decode("ascii"))
    return "".join(out)


class EscapingFormatter(logging.Formatter):
    """A log line per record, whatever the names in it: the message is escaped
    (a traceback appended after it keeps its lines).

    A record with `lines` (`extra={"lines": [...]}`: many events of one
    moment, e.g. the files one store call published) is written as one line
    per item, each escaped and with the record's time and level: one call
    to the handler (one write, one size check of a rotating log) for all of
    them."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        lines = getattr(record, "lines", None)
        if lines is None:
            record.message = printable(record.message)
            return super().formatMessage(record)
        out = []
        for line in lines:
            record.message = printable(line)
            out.append(super().formatMessage(record))
        return "\n".join(out)
