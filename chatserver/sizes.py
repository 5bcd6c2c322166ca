"""Sizes and limits in the words a person reads: KB, MB and GB (binary, as file managers count),
never a count of bytes past a thousand, and a limit named with the setting that changes it."""

from __future__ import annotations


def size_words(n: int) -> str:
    """1536 → "1.5 KB", 20971520 → "20 MB", 900 → "900 bytes"."""
    for unit, size in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if n >= size:
            value = n / size
            text = f"{value:.0f}" if value >= 100 else f"{value:.1f}".removesuffix(".0")
            return f"{text} {unit}"
    return f"{n} bytes"


def admin_setting(name: str) -> str:
    """How an error names the setting behind a limit the person cannot change themselves."""
    return f"the server's {name} setting, which whoever runs it can raise"
