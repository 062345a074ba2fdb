"""Byte sizes as people write them: parse "512MiB", "2GiB", "1.5GB", "4096"; format for reports."""
from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "tb": 1000**4}


def parse_bytes(text: str) -> int:
    """Bytes in `text` ("512MiB", "2GiB", "1.5GB", "4096"); raise ValueError when it is not a size."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"'{text}' is not a size (write e.g. 512MiB, 2GiB, 1.5GB or a number of bytes)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(nbytes: int) -> str:
    """'12.3 MiB', '512 B'."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
