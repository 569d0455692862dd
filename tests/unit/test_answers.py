r"""The answer checker: extraction, normalisation, numeric and symbolic equivalence, and that
no input makes it raise or hang (replay_pipeline/tasks/answers.py)."""

from __future__ import annotations

import random
import time

import pytest

from replay_pipeline.tasks.answers import (
    extract_answer, extract_boxed, extract_final, extract_gsm8k, is_equivalent, last_number,
    normalize_answer, parse_number, symbolic_available,
)
from fractions import Fraction

needs_sympy = pytest.mark.skipif(not symbolic_available(), reason="sympy is not installed")


# ---------------------------------------------------------------------------- extraction

@pytest.mark.parametrize(("text", "expected"), [
    ("Natalia sold 48/2 = 24 clips in May.\n48+24 = 72\n#### 72", "72"),
    ("#### 1,000", "1,000"),
    ("first #### 3\nthen corrected\n#### 5", "5"),           # the last marker
    ("####   -7.5  \n", "-7.5"),
    ("#### $18 dollars\nDone.", "$18 dollars"),             # the line, normalised later
    ("####\n\n42", "42"),                                    # next non-empty line
    ("no marker here 42", None),
    ("ends with ####", None),
    ("", None),
])
def test_gsm8k_extraction(text, expected):
    assert extract_gsm8k(text) == expected
    assert extract_answer(text, "gsm8k") == expected


@pytest.mark.parametrize(("text", "expected"), [
    (r"so the answer is $\boxed{5}$.", "5"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\frac{\sqrt{3}}{2}} done", r"\frac{\sqrt{3}}{2}"),     # nested braces
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),                              # escaped braces inside
    (r"first \boxed{1} then \boxed{x^{2}+1}", "x^{2}+1"),            # the last box
    (r"\fbox{7}", "7"),
    (r"\boxed 5$ and more", "5"),                                    # \boxed 5 form
    (r"\boxed {  12 }", "12"),
    (r"\boxed{12", None),                                            # unclosed: cut off
    (r"\boxed{3} then \boxed{", None),                               # the last box is unfinished
    (r"\boxed{}", None),
    (r"\boxedx{3}", None),                                           # not the command
    ("nothing", None),
])
def test_boxed_extraction(text, expected):
    assert extract_boxed(text) == expected
    assert extract_answer(text, "math") == expected


def test_each_style_accepts_the_other_marker_and_auto_takes_the_last():
    assert extract_answer(r"so \boxed{4}", "gsm8k") == "4"
    assert extract_answer("so\n#### 4", "math") == "4"
    assert extract_answer("#### 3\nno, \\boxed{4}", "auto") == "4"
    assert extract_answer("\\boxed{4}\nno:\n#### 3", "auto") == "3"
    assert extract_answer("#### 3\nno, \\boxed{4}", "gsm8k") == "3"


@pytest.mark.parametrize(("text", "fallback", "expected"), [
    ("She has 3 apples and buys 4, so 7.", "last_number", "7"),
    ("The total is 1,250 dollars in the end", "last_number", "1,250"),
    ("half: 3/4", "last_number", "3/4"),
    ("She has 3 apples and buys 4, so 7.", None, None),
    ("no numbers", "last_number", None),
    ("#### 5 then 9", "last_number", "5 then 9"),  # a marker wins over the fallback
])
def test_last_number_fallback(text, fallback, expected):
    assert extract_answer(text, "gsm8k", fallback=fallback) == expected


@pytest.mark.parametrize(("text", "style", "complete"), [
    ("#### 42", "gsm8k", False),            # may be the prefix of "#### 420"
    ("#### 42\n", "gsm8k", True),
    ("#### 42\nQuestion: next", "gsm8k", True),
    (r"\boxed{42}", "math", True),          # a closed box is complete
    (r"\boxed 42", "math", False),
])
def test_extract_final_says_whether_the_answer_is_complete(text, style, complete):
    answer, done = extract_final(text, style)
    assert answer is not None and done is complete


def test_last_number_helper_and_bad_arguments():
    assert last_number("a 1 b -2.5 c") == "-2.5" and last_number("none") is None
    with pytest.raises(ValueError, match="style"):
        extract_answer("x", "latex")
    with pytest.raises(ValueError, match="fallback"):
        extract_answer("x", "gsm8k", fallback="first_number")


# ---------------------------------------------------------------------------- normalisation

@pytest.mark.parametrize(("raw", "expected"), [
    ("  42  ", "42"),
    ("$18", "18"),
    (r"\$18.00", "18"),
    ("18.50", "18.5"),
    (".5", "0.5"),
    ("+7", "7"),
    ("1,000", "1000"),
    ("1,234,567.89", "1234567.89"),
    ("1{,}000", "1000"),
    ("18 dollars", "18"),
    ("5 square feet", "5"),
    (r"5\text{ cm}^2", "5"),
    (r"\text{(B)}", "B"),
    ("x = 5", "5"),
    (r"\theta = \frac{\pi}{2}", r"\frac{\pi}{2}"),
    ("The answer is 42.", "42"),
    (r"\left( 1, 2 \right)", "(1,2)"),
    (r"\dfrac{3}{4}", r"\frac{3}{4}"),
    (r"\tfrac12", r"\frac{1}{2}"),
    (r"\frac1{x}", r"\frac{1}{x}"),
    (r"\sqrt2", r"\sqrt{2}"),
    (r"90^\circ", "90"),
    (r"90^{\circ}", "90"),
    ("90\u00b0", "90"),
    (r"50\%", "50"),
    ("50%", "50"),
    (r"\text{Monday}", "monday"),
    ("No Solution", "no solution"),
    (r"3 \cdot z", r"3\cdot z"),       # a command keeps its separation from a letter
    ("**72**", "72"),
    ("\u22123", "-3"),                  # unicode minus
    ("", ""),
])
def test_normalisation(raw, expected):
    assert normalize_answer(raw) == expected


def test_units_are_kept_when_asked():
    assert normalize_answer("18 dollars", strip_units=False) == "18dollars"
    assert normalize_answer("x + y", strip_units=True) == "x+y"  # no number: nothing stripped


@pytest.mark.parametrize(("text", "value"), [
    ("42", Fraction(42)), ("-3", Fraction(-3)), ("2.50", Fraction(5, 2)), ("3/4", Fraction(3, 4)),
    (r"\frac{3}{4}", Fraction(3, 4)), (r"-\frac{3}{4}", Fraction(-3, 4)), (r"\frac{-3}{4}", Fraction(-3, 4)),
    (r"2\frac{1}{2}", Fraction(5, 2)), ("1.5e3", Fraction(1500)), (r"1.5\times10^{3}", Fraction(1500)),
    ("2e-2", Fraction(1, 50)), ("(5)", Fraction(5)),
    ("3/0", None), (r"\frac{1}{0}", None), ("x", None), ("1e99999", None), ("", None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


# ---------------------------------------------------------------------------- equivalence

EQUIVALENT = [
    ("72", "72"),
    ("72.0", "72"),
    ("$72", "72"),
    ("72 dollars", "72"),
    ("1,000", "1000"),
    ("1000.00", "1,000"),
    (r"\frac{1}{2}", "0.5"),
    (r"\dfrac{1}{2}", "1/2"),
    ("3/4", r"\frac34"),
    ("0.75", r"\frac{3}{4}"),
    ("50%", "50"),
    ("50%", "0.5"),
    (r"12.5\%", r"\frac{1}{8}"),
    ("1.5e3", "1500"),
    (r"1.5 \times 10^{3}", "1500"),
    (r"2\frac{1}{2}", "5/2"),
    ("0.3333333", r"\frac{1}{3}"),     # within the relative tolerance
    ("x = 5", "5"),
    (r"\text{(B)}", "B"),
    (r"90^\circ", "90"),
    ("(1, 2)", "(1,2)"),
    (r"\left(1, \frac{1}{2}\right)", "(1, 0.5)"),
    (r"[0, \frac{1}{2})", "[0,0.5)"),
    (r"(-\infty, 3]", r"(-\infty,3]"),
    ("1, 2", "2, 1"),                  # lists of solutions: any order
    (r"\{3, 1, 2\}", r"\{1, 2, 3\}"),
    (r"\text{Monday}", "monday"),
]
EQUIVALENT_SYMBOLIC = [
    (r"\frac{1}{2}", r"\frac{2}{4}"),
    (r"2\sqrt{2}", r"\sqrt{8}"),
    (r"\frac{\sqrt{3}}{3}", r"\frac{1}{\sqrt{3}}"),
    (r"\sqrt{2}/2", r"\frac{\sqrt{2}}{2}"),
    (r"\pi", "3.14159265358979"),
    (r"\frac{\pi}{2}", r"0.5\pi"),
    ("x^2+2x+1", "(x+1)^2"),
    (r"\frac{x^2-1}{x-1}", "x+1"),
    (r"\sin^2 x + \cos^2 x", "1"),
    (r"e^{i\pi}", "-1"),
    ("3+4i", "4i+3"),
    ("10!", "3628800"),
    (r"\binom{5}{2}", "10"),
    (r"\sqrt[3]{8}", "2"),
    ("2^{10}", "1024"),
    ("y = 2x + 1", "y = 1 + 2x"),
    ("x + y = 1", "y + x = 1"),
    (r"(\sqrt{2}, \frac{1}{2})", r"(\frac{2}{\sqrt{2}}, 0.5)"),
    (r"2 \cdot 3a", "6a"),
    (r"\sin(\pi)", "0"),               # no significant digits numerically: simplify decides
    ("x - x", "0"),
]
NOT_EQUIVALENT = [
    ("72", "73"),
    ("1000000", "1000001"),            # integers: exact, no tolerance
    ("0.33", r"\frac{1}{3}"),          # an approximation is not the answer
    ("3/4", "4/3"),
    ("50%", "5"),
    ("(1, 2)", "(2, 1)"),              # tuples: in order
    ("[1, 2)", "(1, 2)"),              # intervals: brackets matter
    ("(1, 2)", "1, 2"),
    ("1, 2", "1, 2, 3"),
    (r"2\sqrt{2}", r"\sqrt{2}"),
    ("x^2+1", "(x+1)^2"),
    ("x", "y"),
    ("listen", "silent"),              # words are not products of variables
    ("no", "on"),
    ("x", "X"),
    ("monday", "tuesday"),
    ("", "0"),
    ("0", ""),
    ("x + y = 1", "x - y = 1"),
    ("5", "x = 6"),
    (r"10^{10^{10}}", "1"),
    ("10^{-20}", "0"),                 # small is not zero
    ("10^{-2000}x", "0"),
]


@pytest.mark.parametrize(("a", "b"), EQUIVALENT)
def test_equivalent(a, b):
    assert is_equivalent(a, b) and is_equivalent(b, a)


@needs_sympy
@pytest.mark.parametrize(("a", "b"), EQUIVALENT_SYMBOLIC)
def test_equivalent_symbolically(a, b):
    assert is_equivalent(a, b) and is_equivalent(b, a)


@pytest.mark.parametrize(("a", "b"), NOT_EQUIVALENT)
def test_not_equivalent(a, b):
    assert not is_equivalent(a, b) and not is_equivalent(b, a)


def test_symbolic_can_be_switched_off():
    assert not is_equivalent(r"2\sqrt{2}", r"\sqrt{8}", symbolic=False)
    assert is_equivalent(r"\frac{1}{2}", "0.5", symbolic=False)  # numbers need no sympy


def test_tolerance_is_a_parameter():
    assert is_equivalent("3.1416", r"\pi", rel_tol=1e-4) and not is_equivalent("3.1416", r"\pi")


# ---------------------------------------------------------------------------- garbage and time

GARBAGE = [
    None, "", " ", "}{", "{{{{", "((((", "\\", "\\frac", "\\frac{", "\\boxed{", "####", "%%%", "$$",
    "\\sqrt[", "^^^", "1/0", "\\frac{1}{0}", "0^0", "x/0", "\\frac{x}{x-x}", "!!!", "\\binom{-1}{2}",
    "\\log(0)", "\\sqrt{-1}", "1e", "1,,2", ",", "(,)", "[1,2", "\\left(", "\x00\x01", "\ud83d\ude00",
    12, 3.5, [1, 2], {"a": 1}, object(), "a" * 10_000, "(" * 5000, "9" * 5000, "\\frac{" * 300,
]


@pytest.mark.parametrize("junk", GARBAGE, ids=lambda j: "object()" if type(j) is object else repr(j)[:30])
def test_garbage_never_raises(junk):
    for other in ("0", "1", junk):
        assert is_equivalent(junk, other) in (True, False)
        assert is_equivalent(other, junk) in (True, False)
    assert isinstance(normalize_answer(junk), str)
    extract_answer(junk, "gsm8k")
    extract_answer(junk, "math", fallback="last_number")
    parse_number(junk)


def test_long_inputs_are_not_equal_by_prefix():
    base = "9" * 5000
    assert not is_equivalent(base, base + "1")
    assert is_equivalent(base, base)  # verbatim equality still holds


HARD = [
    "2^{2^{2^{2^{2^{2}}}}}",                 # a tower: refused, not computed
    "10^{10^{10}}",
    "9^{9^{9}}",
    "500!",
    "(x+1)^{9999}",
    "\\sqrt{" + "9" * 190 + "}",
    "x^{x^{x^{x^{x^{x^{x^{x}}}}}}}",          # taller than MAX_TOWER: refused
    "\\exp(\\exp(\\exp(\\exp(x))))",
    "x^{x^{100}}",
    "((x^{10000})^{10000})^{10000}",
    "x^{1000}-x^{1000}",
    "\\sin(10^{2000})",
    "((((((((((((((((((((x+1))))))))))))))))))))" * 2,
    "\\sin(\\sin(\\sin(\\sin(\\sin(\\sin(\\sin(\\sin(x))))))))",
    "+".join(f"x^{{{k}}}" for k in range(30)),
    "(" + "+".join("xyzuv") + ")^{12}",
    "-" * 199 + "1",
    "\\frac{\\frac{\\frac{\\frac{\\frac{1}{x}}{y}}{z}}{u}}{v}",
]


@needs_sympy
@pytest.mark.parametrize("expr", HARD, ids=lambda e: e[:25])
def test_hard_expressions_return_quickly(expr):
    is_equivalent("0", "0")  # import sympy outside the timing
    for other in ("0", "x", expr + "+1", "(" + expr + ")\\cdot 1"):
        start = time.perf_counter()
        result = is_equivalent(expr, other)
        assert result in (True, False)
        assert time.perf_counter() - start < 3.0, (expr, other)


@needs_sympy
def test_random_expressions_never_raise_or_stall():
    rng = random.Random(7)
    tokens = ["x", "y", "2", "3", "10", "^", "{", "}", "(", ")", "\\frac", "\\sqrt", "+", "-", "*", "/", "!",
              "\\pi", "e", "i", "\\sin", "\\log", ",", "=", "\\infty", "9999", "0.5", "%", "\\{", "\\}", "[", "]",
              "\\cdot", "\\binom", "\\boxed{", "####", "$", "\\text{", " ", "x=", "1,000"]
    start = time.perf_counter()
    for _ in range(300):
        a = "".join(rng.choice(tokens) for _ in range(rng.randint(1, 40)))
        b = "".join(rng.choice(tokens) for _ in range(rng.randint(1, 40)))
        for x, y in ((a, b), (a, a + "+0"), (a, "(" + a + ")")):
            assert is_equivalent(x, y) in (True, False)
        extract_answer(a, "auto", fallback="last_number")
    assert time.perf_counter() - start < 60
