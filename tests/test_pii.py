"""PII masking: every kind masked in its usual spellings, ordinary numbers left alone."""

from __future__ import annotations

import pytest

from chatserver.conversations.pii import mask

SHOULD_MASK = [
    # phones, Korean forms
    ("call 010-1234-5678 now", "call [phone] now"),
    ("01012345678", "[phone]"),
    ("010.1234.5678", "[phone]"),
    ("010 1234 5678", "[phone]"),
    ("016-123-4567", "[phone]"),
    ("서울 02-123-4567 대표", "서울 [phone] 대표"),
    ("02-1234-5678", "[phone]"),
    ("031-123-4567", "[phone]"),
    ("070-1234-5678", "[phone]"),
    ("전화010-1234-5678로", "전화[phone]로"),
    ("+82 10-1234-5678", "[phone]"),
    ("+82-10-1234-5678", "[phone]"),
    ("+821012345678", "[phone]"),
    ("+82 2 123 4567", "[phone]"),
    # phones, international
    ("+1 212 555 0123", "[phone]"),
    ("+1 (212) 555-0123.", "[phone]."),
    ("+44 20 7946 0958", "[phone]"),
    ("+49-30-1234567", "[phone]"),
    ("+33 1 23 45 67 89", "[phone]"),
    ("+14155552671", "[phone]"),
    # e-mail
    ("mail kim.minsu+work@example.co.kr please", "mail [email] please"),
    ("<a_b-c@sub.domain.org>", "<[email]>"),
    ("메일은 hong123@naver.com 입니다", "메일은 [email] 입니다"),
    # resident registration numbers
    ("900101-1234567", "[rrn]"),
    ("주민번호 850315-2345678입니다", "주민번호 [rrn]입니다"),
    ("0402293456789", "[rrn]"),  # 2004-02-29, a leap day, century digit 3
    ("991231-6123456", "[rrn]"),  # foreigner, 1900s
    ("010101-4123456", "[rrn]"),
    # payment cards (Luhn-valid)
    ("4111 1111 1111 1111", "[card]"),
    ("4111-1111-1111-1111", "[card]"),
    ("card 4111111111111111 exp", "card [card] exp"),
    ("5555 5555 5555 4444", "[card]"),
    ("3782 822463 10005", "[card]"),  # Amex 4-6-5
    ("6011000990139424", "[card]"),
    ("카드번호:4012888888881881", "카드번호:[card]"),
    ("4000 0000 0000 0000 006", "[card]"),  # 19 digits
]

MUST_NOT_MASK = [
    "$1,234.56", "₩15,000", "1234567원", "15,000원", "USD 1,000,000.00", "€ 99.99",
    "2026-12-01", "2026.12.01", "12/01/2026", "01.12.2026", "02.12.2026", "2026년 12월 1일",
    "1.108.3", "v2.14.4", "version 10.0.19045.3803", "python 3.11.9",
    "12:30", "12:30:45", "09:00-18:00", "1990-2024",
    "order 1234-5678-9012-3456",  # fails Luhn
    "4111 1111 1111 1112",  # fails Luhn
    "1234567890123", "12345678", "42", "3.14159", "1764590400000",
    "192.168.0.1", "10.0.0.1", "127.0.0.1:8000", "2001:db8::1",
    "901301-1234567",  # month 13
    "900230-1234567",  # 30 February
    "900101-9234567",  # century digit 9 (1800s) is not issued
    "010-1234-56789",  # one digit too many
    "+1", "+15%", "score +3.5", "x = 1e10",
    "user@localhost", "@handle", "a@b",
    "ISBN 978-3-16-148410-0", "SKU-0101234567890",
]


# Spellings that slipped through before matching ran on a normalised view (NFKC, zero-width and
# other format characters left out, every dash a hyphen, every space a space).
ZW, NBSP = "\u200b", "\u00a0"
SLIPPED = [
    # full-width digits, hyphen, plus and ＠
    ("０１０－１２３４－５６７８", "[phone]"),
    ("전화 ０１０１２３４５６７８ 주세요", "전화 [phone] 주세요"),
    ("＋８２ １０ １２３４ ５６７８", "[phone]"),
    ("kim＠example.com", "[email]"),
    ("ｋｉｍ＠ｅｘａｍｐｌｅ．ｃｏｍ", "[email]"),
    ("９００１０１－１２３４５６７", "[rrn]"),
    ("４１１１ １１１１ １１１１ １１１１", "[card]"),
    # no-break and other spaces
    (f"010{NBSP}1234{NBSP}5678", "[phone]"),
    ("4111\u202f1111\u202f1111\u202f1111", "[card]"),
    ("+82\u300010\u30001234\u30005678", "[phone]"),
    # en dash, em dash, minus sign, non-breaking hyphen
    ("010–1234–5678", "[phone]"),
    ("900101–1234567", "[rrn]"),
    ("4111—1111—1111—1111", "[card]"),
    ("02\u22121234\u22125678", "[phone]"),
    ("010\u20111234\u20115678", "[phone]"),
    # zero-width characters and the soft hyphen inside a number or an address
    (f"010{ZW}-1234-{ZW}5678", "[phone]"),
    ("0\u200c1\u200d0\u20601234\ufeff5678", "[phone]"),
    (f"hong{ZW}@naver.com", "[email]"),
    ("9001\u00ad01-1234567", "[rrn]"),
    (f"4111{ZW}1111{ZW}1111{ZW}1111", "[card]"),
    # card numbers with dots
    ("4111.1111.1111.1111", "[card]"),
    ("카드 5555.5555.5555.4444 결제", "카드 [card] 결제"),
    # a resident number with a space
    ("900101 1234567", "[rrn]"),
    ("주민번호 850315 2345678 입니다", "주민번호 [rrn] 입니다"),
    # internationalised e-mail
    ("홍길동@회사.한국", "[email]"),
    ("josé.garcía@correo.es", "[email]"),
    ("用户@例子.广告", "[email]"),
    ("почта@пример.рф", "[email]"),
    ("user@bücher.de", "[email]"),
    ("메일 hong@naver.com으로 보내요", "메일 [email]으로 보내요"),
    ("e\u0301mile@example.fr", "[email]"),
    # area codes in parentheses
    ("(02) 123-4567", "[phone]"),
    ("(02)1234-5678", "[phone]"),
    ("대표 (031) 123-4567", "대표 [phone]"),
    ("(010) 1234-5678", "[phone]"),
    ("（０２）１２３－４５６７", "[phone]"),
    # other scripts' digits, bidi controls
    ("٠١٠-١٢٣٤-٥٦٧٨", "[phone]"),
    ("010\u202e-1234-5678", "[phone]"),
]

SLIPPED_MUST_NOT_MASK = [
    "２０２６－１２－０１", "ｖ２．１４．４", "2026–12–01", "12:30–18:00", "1990–2024",
    f"1{NBSP}234{NBSP}567원", "₩15,000", "(02) 12", "(1) 2 3", "version 10.0.19045.3803",
    "192.168.0.1", "3.14159", f"price{ZW}42", "user＠localhost", "４１１１ １１１１ １１１１ １１１２",
    "9013 01 1234567", "1.108.3",
]


@pytest.mark.parametrize(("text", "masked"), SLIPPED)
def test_other_spellings_of_each_kind_are_masked(text, masked):
    assert mask(text) == (masked, 1)


@pytest.mark.parametrize("text", SLIPPED_MUST_NOT_MASK)
def test_other_spellings_of_ordinary_numbers_stay(text):
    assert mask(text) == (text, 0)


def test_only_the_masked_span_changes_the_rest_stays_as_written():
    text = f"Ｈｉ！{NBSP}call ０１０–１２３４–５６７８{ZW}, ok — café ２０２６"
    assert mask(text) == (f"Ｈｉ！{NBSP}call [phone]{ZW}, ok — café ２０２６", 1)


def test_a_long_text_is_masked_quickly():
    import time

    from chatserver.conversations import pii

    pii.prepare()  # the server builds its table at start
    text = ("가나다라\u00a0" * 20_000 + "０１０－１２３４－５６７８ ") * 10  # a million characters, 200,000 changed
    started = time.perf_counter()
    masked, count = mask(text)
    assert count == 10 and time.perf_counter() - started < 5


@pytest.mark.parametrize(("text", "masked"), SHOULD_MASK)
def test_each_kind_is_masked(text, masked):
    assert mask(text) == (masked, 1)


@pytest.mark.parametrize("text", MUST_NOT_MASK)
def test_ordinary_numbers_stay(text):
    assert mask(text) == (text, 0)


def test_a_message_with_several_kinds_counts_each():
    text = ("연락처 010-1234-5678, 메일 a@example.com, 주민번호 900101-1234567, "
            "카드 4111 1111 1111 1111, 가격 ₩15,000, 날짜 2026-12-01, 버전 v2.14.4")
    assert mask(text) == ("연락처 [phone], 메일 [email], 주민번호 [rrn], "
                          "카드 [card], 가격 ₩15,000, 날짜 2026-12-01, 버전 v2.14.4", 4)


def test_masking_twice_changes_nothing_more():
    once, _ = mask("010-1234-5678 / a@example.com")
    assert mask(once) == (once, 0)
