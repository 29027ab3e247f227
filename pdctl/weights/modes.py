"""The weight push's closed sets of words (``(str, Enum)``: equal to their strings)."""

from __future__ import annotations

from pdctl.choices import Choice


class VerifyMode(Choice):
    """How the engines' checksums of pushed tensors are compared with the trainer's."""

    AUTO = "auto"
    """``sample`` when every engine is a sim, else ``off``."""
    SAMPLE = "sample"
    FULL = "full"
    OFF = "off"


class LoadFormat(Choice):
    """How a bucket is sent: SGLang's ``flattened_bucket`` (one tensor), or tensor by tensor."""

    AUTO = "auto"
    FLATTENED_BUCKET = "flattened_bucket"
    NAMES = "names"
