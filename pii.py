"""PII masking: `mask(text) -> (masked, count)` for PII_MASKING=on.

Replaces e-mail addresses by `[email]`, Korean resident registration numbers (a real date and a
gender/century digit 1-8) by `[rrn]`, payment card numbers (13-19 digits, Luhn-valid) by `[card]`
and phone numbers (Korean forms and +country international ones) by `[phone]`. Prices, dates,
versions, times, IP addresses and numbers that fail the checks stay as they are. Digits are
ASCII only, and Hangul may touch a number ("전화010-1234-5678"). Knows nothing of where the text
goes; the caller decides when to mask.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import date

# Not inside a longer run of digits, letters, or a dotted/dashed number ("v2.010-1234-5678").
_START = r"(?<![0-9A-Za-z.+-])"
_END = r"(?![0-9])(?![.-][0-9])"

_EMAIL = re.compile(
    r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*\.[A-Za-z]{2,}(?![A-Za-z0-9])"
)
_RRN = re.compile(_START + r"([0-9]{2})([0-9]{2})([0-9]{2})-?([1-8])[0-9]{6}" + _END)
# Digits with one kind of separator (space or dash) between groups, or none.
_CARD = re.compile(_START + r"[0-9]{3,6}(?:([ -])[0-9]{3,6}(?:\1[0-9]{1,6}){1,4}|[0-9]{7,13})" + _END)
_SEP = r"[ .-]?"
_KOREAN_PHONE = re.compile(
    _START + r"(?:01[016789]|02|0[3-6][1-5]|070|080|050[0-9])" + _SEP + r"[0-9]{3,4}" + _SEP + r"[0-9]{4}" + _END
)
# +country code, then groups of digits (an area code may sit in parentheses), 8-15 digits in all.
_INTL_PHONE = re.compile(
    r"(?<![0-9A-Za-z+])\+[1-9][0-9]{0,2}(?:[ .-]?(?:\([0-9]{1,4}\)|[0-9]{1,5})){1,6}" + _END
)


def mask(text: str) -> tuple[str, int]:
    """The text with each phone number, e-mail address, RRN and card number replaced, and how many were."""
    count = 0
    for pattern, placeholder, valid in _KINDS:
        def replace(match: re.Match, placeholder: str = placeholder, valid: Callable = valid) -> str:
            nonlocal count
            if not valid(match):
                return match.group(0)
            count += 1
            return placeholder
        text = pattern.sub(replace, text)
    return text, count


def _always(_: re.Match) -> bool:
    return True


def _plausible_rrn(match: re.Match) -> bool:
    """A birth date that exists, in the century the gender digit names (1,2,5,6: 1900s; 3,4,7,8: 2000s)."""
    yy, mm, dd, code = (int(g) for g in match.groups())
    year = (1900 if code in (1, 2, 5, 6) else 2000) + yy
    try:
        date(year, mm, dd)
    except ValueError:
        return False
    return True


def _luhn_card(match: re.Match) -> bool:
    digits = [int(c) for c in match.group(0) if c.isdigit()]
    if not 13 <= len(digits) <= 19:
        return False
    total = 0
    for i, digit in enumerate(reversed(digits)):
        if i % 2:
            digit = digit * 2 - 9 if digit > 4 else digit * 2
        total += digit
    return total % 10 == 0


def _phone_digits(match: re.Match) -> bool:
    return 8 <= sum(c.isdigit() for c in match.group(0)) <= 15


# Order matters: an e-mail address holds digits, a card number is longer than a phone number.
_KINDS = [
    (_EMAIL, "[email]", _always),
    (_RRN, "[rrn]", _plausible_rrn),
    (_CARD, "[card]", _luhn_card),
    (_INTL_PHONE, "[phone]", _phone_digits),
    (_KOREAN_PHONE, "[phone]", _always),
]
