"""PII masking: `mask(text) -> (masked, count)` for PII_MASKING=on.

Replaces e-mail addresses (internationalised ones too) by `[email]`, Korean resident registration
numbers (a real date and a gender/century digit 1-8) by `[rrn]`, payment card numbers (13-19
digits, Luhn-valid) by `[card]` and phone numbers (Korean forms, `(02) 123-4567` included, and
+country international ones) by `[phone]`. Prices, dates, versions, times, IP addresses and
numbers that fail the checks stay as they are.

Matching runs on a normalised view of the text, so that spelling a number differently does not
hide it: NFKC (full-width digits and `＠` become ASCII), format characters (zero-width spaces and
joiners, the soft hyphen, bidi controls) and combining marks left out, every dash and minus a
hyphen, every space a space, other scripts' decimal digits ASCII. Each match replaces the span of
the original text it came from; everything else stays exactly as the person wrote it. Hangul may
touch a number ("전화010-1234-5678"); an e-mail address written against text of a script without
spaces takes that text with it. Knows nothing of where the text goes; the caller decides when to mask.
"""

from __future__ import annotations

import bisect
import functools
import re
import unicodedata
from collections.abc import Callable
from datetime import date

# Not inside a longer run of digits, letters, or a dotted/dashed number ("v2.010-1234-5678").
_START = r"(?<![0-9A-Za-z.+-])"
_END = r"(?![0-9])(?![.-][0-9])"

# Letters and digits of any script (`\w` less `_`), for internationalised addresses.
_LABEL = r"[^\W_](?:[\w-]*[^\W_])?"
_EMAIL = re.compile(
    r"(?<![\w.%+-])[\w.%+-]+@" + _LABEL + r"(?:\." + _LABEL + r")*"
    # An ASCII top-level domain may be followed by Hangul ("a@b.com으로"); any other ends the word.
    r"\.(?:[A-Za-z]{2,}(?![A-Za-z0-9])|[^\W\d_]{2,}(?!\w))"
)
_RRN = re.compile(_START + r"([0-9]{2})([0-9]{2})([0-9]{2})[- ]?([1-8])[0-9]{6}" + _END)
# Digits with one kind of separator (space, dot or dash) between groups, or none.
_CARD = re.compile(_START + r"[0-9]{3,6}(?:([ .-])[0-9]{3,6}(?:\1[0-9]{1,6}){1,4}|[0-9]{7,13})" + _END)
_SEP = r"[ .-]?"
_KOREAN_AREA = r"(?:01[016789]|02|0[3-6][1-5]|070|080|050[0-9])"
_KOREAN_PHONE = re.compile(
    _START + r"(?:" + _KOREAN_AREA + _SEP + r"|\(" + _KOREAN_AREA + r"\) ?)"
    + r"[0-9]{3,4}" + _SEP + r"[0-9]{4}" + _END
)
# +country code, then groups of digits (an area code may sit in parentheses), 8-15 digits in all.
_INTL_PHONE = re.compile(
    r"(?<![0-9A-Za-z+])\+[1-9][0-9]{0,2}(?:[ .-]?(?:\([0-9]{1,4}\)|[0-9]{1,5})){1,6}" + _END
)

# Stands in the view for what a kind already matched: no later pattern matches across or next to it.
_TAKEN = "\ue000"


def mask(text: str) -> tuple[str, int]:
    """The text with each phone number, e-mail address, RRN and card number replaced, and how many were."""
    view = _View(text)
    seen = view.text
    spans: list[tuple[int, int, str]] = []
    for pattern, placeholder, valid in _KINDS:
        found = [(m.start(), m.end()) for m in pattern.finditer(seen) if valid(m)]
        if not found:
            continue
        spans += [(start, end, placeholder) for start, end in found]
        seen = _taken(seen, found)
    if not spans:
        return text, 0
    out, last = [], 0
    for start, end, placeholder in sorted(spans):
        first, after = view.original_span(start, end)
        out += [text[last:first], placeholder]
        last = after
    out.append(text[last:])
    return "".join(out), len(spans)


def mask_conversation(conv: dict) -> int:
    """Mask, in place, the personal text of a conversation made outside a turn (an import): its
    title, system prompt, summary and every message with its activity steps; how many items were masked."""
    total = 0

    def masked(text: str) -> str:
        nonlocal total
        text, count = mask(text)
        total += count
        return text

    conv["title"] = masked(conv["title"])
    conv["summary"] = masked(conv.get("summary") or "")
    for fold in conv.get("folds") or []:
        fold["summary"] = masked(fold["summary"])
    settings = conv.get("settings") or {}
    if isinstance(settings.get("system_prompt"), str):
        settings["system_prompt"] = masked(settings["system_prompt"])
    for key in ("messages", "archive", "off_path"):
        for message in conv.get(key) or []:
            if isinstance(message.get("content"), str):
                message["content"] = masked(message["content"])
            # An imported reply's reasoning and tool steps are the file's text too.
            for step in message.get("activity") or []:
                for field in ("text", "summary", "error", "query"):
                    if isinstance(step.get(field), str):
                        step[field] = masked(step[field])
                arguments = step.get("arguments")
                if isinstance(arguments, dict):
                    step["arguments"] = {k: masked(v) if isinstance(v, str) else v for k, v in arguments.items()}
    return total


def prepare() -> None:
    """Build the table of characters the view changes now (a few tenths of a second), not on the first message."""
    _changing()


class _View:
    """The normalised text, and where each of its characters came from in the original."""

    def __init__(self, text: str) -> None:
        self._starts: list[int] = []  # where each segment begins in the view
        self._segments: list[tuple[int, bool]] = []  # (its start in the original, copied as is)
        if text.isascii():
            self.text = text
            self._note(0, 0, True)
            return
        pieces: list[str] = []
        length = last = 0
        for run in _changing().finditer(text):
            if run.start() > last:
                pieces.append(text[last:run.start()])
                self._note(length, last, True)
                length += run.start() - last
            for i in range(run.start(), run.end()):
                if shown := _view_of(text[i]):
                    pieces.append(shown)
                    self._note(length, i, False)
                    length += len(shown)
            last = run.end()
        if last < len(text) or not pieces:
            pieces.append(text[last:])
            self._note(length, last, True)
        self.text = "".join(pieces)

    def _note(self, view_start: int, original_start: int, copied: bool) -> None:
        self._starts.append(view_start)
        self._segments.append((original_start, copied))

    def _original(self, index: int) -> tuple[int, bool]:
        segment = bisect.bisect_right(self._starts, index) - 1
        original_start, copied = self._segments[segment]
        return (original_start + index - self._starts[segment], copied) if copied else (original_start, copied)

    def original_span(self, start: int, end: int) -> tuple[int, int]:
        """The original text's span that view[start:end] came from (whole characters)."""
        first, _ = self._original(start)
        last, _ = self._original(end - 1)
        return first, last + 1


def _taken(text: str, spans: list[tuple[int, int]]) -> str:
    out, last = [], 0
    for start, end in spans:
        out += [text[last:start], _TAKEN * (end - start)]
        last = end
    out.append(text[last:])
    return "".join(out)


@functools.cache
def _changing() -> re.Pattern:
    """Runs of characters the view does not copy as they are (built once, on first use)."""
    changing = []
    for code in (*range(0x80, 0x30000), *range(0xE0000, 0xE1000)):  # the planes in use, tags included
        if 0xD800 <= code < 0xE000:
            continue
        char = chr(code)
        if unicodedata.category(char) != "Cn" and _view_of(char) != char:
            changing.append(code)
    ranges: list[list[int]] = []
    for code in changing:
        if ranges and ranges[-1][1] == code - 1 and code != 0x10000:
            ranges[-1][1] = code
        else:
            ranges.append([code, code])
    def members(part: list[list[int]]) -> str:
        return "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in part)

    # The engine looks a character up in a table when its class lies within the first plane, and
    # walks the class otherwise: astral characters are tried against a class of their own.
    plane = [r for r in ranges if r[1] < 0x10000]
    astral = [r for r in ranges if r[1] >= 0x10000]
    return re.compile(f"(?:[{members(plane)}]|(?=[\\U00010000-\\U0010ffff])[{members(astral)}])+")


@functools.lru_cache(maxsize=4096)
def _view_of(char: str) -> str:
    """What one character is in the view: NFKC, then each resulting character simplified."""
    return "".join(map(_simple, unicodedata.normalize("NFKC", char)))


def _simple(char: str) -> str:
    category = unicodedata.category(char)
    if category in ("Cf", "Mn", "Me"):
        return ""
    if category == "Pd" or char == "\u2212":  # dashes, and the minus sign
        return "-"
    if category == "Zs":
        return " "
    if char > "\x7f" and (digit := unicodedata.decimal(char, None)) is not None:
        return str(digit)
    return char


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
_KINDS: list[tuple[re.Pattern, str, Callable[[re.Match], bool]]] = [
    (_EMAIL, "[email]", _always),
    (_RRN, "[rrn]", _plausible_rrn),
    (_CARD, "[card]", _luhn_card),
    (_INTL_PHONE, "[phone]", _phone_digits),
    (_KOREAN_PHONE, "[phone]", _always),
]
