"""The weight push's closed sets of words (``(str, Enum)``: equal to their strings)."""

from __future__ import annotations

from pdctl.choices import Choice
from pdctl.refit import VerifyMode

__all__ = ["LoadFormat", "VerifyMode"]


class LoadFormat(Choice):
    """How a bucket is sent: SGLang's ``flattened_bucket`` (one tensor), or tensor by tensor."""

    AUTO = "auto"
    FLATTENED_BUCKET = "flattened_bucket"
    NAMES = "names"
