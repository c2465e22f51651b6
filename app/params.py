"""Path parameters the routes share. No id or artifact file path holds a control character
(PostgreSQL refuses NUL in text, and none names anything here): such a request is a 422 naming
the parameter, decided before any query runs, on every database alike."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import Path

# The OpenAPI pattern of every path id (a regular expression both pydantic and clients read).
NO_CONTROL_CHARS = r"^[^\x00-\x1f\x7f]+$"
NO_CONTROL_CHARS_MESSAGE = "must not contain control characters (U+0000-U+001F, U+007F)"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

JobId = Annotated[str, Path(description="a job id", pattern=NO_CONTROL_CHARS)]
CalibrationId = Annotated[str, Path(description="a calibration id", pattern=NO_CONTROL_CHARS)]
FilePath = Annotated[
    str, Path(description="a file path inside the artifact", pattern=NO_CONTROL_CHARS)
]


def has_control_char(text: str) -> bool:
    """True when text holds a character no id may hold (for ids read from cursors, tokens)."""
    return _CONTROL.search(text) is not None
