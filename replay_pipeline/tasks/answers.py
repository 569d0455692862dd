r"""Final-answer checking for math tasks: extract, normalise, compare. Pure functions.

    extract_answer("... so she pays 18 dollars.\n#### 18", style="gsm8k")  -> "18"
    extract_answer(r"... hence \boxed{\frac{1}{2}}.", style="math")       -> r"\frac{1}{2}"
    is_equivalent(r"\frac{1}{2}", "0.5")                                  -> True
    is_equivalent(r"2\sqrt{2}", r"\sqrt{8}")                              -> True

Decisions:

Extraction (:func:`extract_answer`)
- GSM8K style: the first non-empty line after the *last* "####". MATH style: the content of
  the *last* ``\boxed{...}`` or ``\fbox{...}`` with balanced braces (escaped ``\{ \}`` do not
  count), or ``\boxed 5``. Each style accepts the other's marker when its own is absent (both
  are explicit final-answer markers); "auto" takes whichever marker comes last.
- An unclosed last ``\boxed{`` (a cut-off completion) is no answer; the checker does not fall
  back to an earlier box, because the model's final answer is the unfinished one.
- ``fallback="last_number"`` (off by default) takes the last number in the text when no
  marker is found. It is lenient (reasoning often ends on a number that is not the answer),
  so tasks use it only when configured to.
- :func:`extract_final` also says whether the answer is *complete*: closed box, or a "####"
  / last-number answer followed by more text. A task can refuse an answer that runs into the
  end of a truncated completion, which could be a prefix ("#### 4" of "#### 42").

Normalisation (:func:`normalize_answer`), in the spirit of the MATH and Minerva scorers but
written here: drops ``$``, ``\(``/``\)``, ``\left``/``\right``, spacing commands, ``\text{}``
-like wrappers (keeping their content), ``^\circ``, percent signs, a leading "x =" (one
letter or command on the left of the only "="), "the answer is", trailing unit words after
a number ("18 dollars", "5 square cm"; ``strip_units``), thousands separators when the whole
answer is a number ("1,000", "1{,}000"), whitespace; ``\dfrac``/``\tfrac`` -> ``\frac``,
``\frac12`` -> ``\frac{1}{2}``, ``\sqrt2`` -> ``\sqrt{2}``; numbers lose a "+" sign and
trailing zeros ("18.00" -> "18", ".5" -> "0.5"); answers made only of words are lower-cased.

Equivalence (:func:`is_equivalent`), first match wins:
1. equal normalised strings;
2. sequences: "(1, 2)" and "[1, 2)" (tuples, intervals: brackets must match, elements in
   order), ``\{1, 2\}`` and bare "1, 2" (sets and lists of solutions: any order), compared
   element by element with the rules below;
3. numbers: integers, decimals, "3/4", ``\frac{3}{4}``, mixed numbers ``2\frac{1}{2}`` (= 5/2,
   as MATH writes them), scientific notation (1.5e3, ``1.5\times10^{3}``), read exactly as
   fractions. Two integers must be equal; otherwise a relative tolerance ``rel_tol`` (1e-6)
   applies, so "0.3333333" matches 1/3 but "0.33" does not. A percentage matches its value
   or its value / 100 ("50%" = "50" = "0.5"); GSM8K references are bare numbers;
4. symbolic, when sympy is installed: both sides are parsed by the small LaTeX-ish parser here
   (``\frac``, ``\sqrt``, ``\sqrt[n]``, ``^``, ``\cdot``, ``\times``, ``\pi``, ``\infty``,
   ``\binom``, trig/log functions, implicit multiplication, "!"; ``i`` is the imaginary unit
   and ``e`` Euler's number) -- never ``sympify`` or ``eval`` of model output. Constant
   expressions are compared by 30-digit numerical evaluation (with ``rel_tol``); expressions
   with variables at five fixed pseudo-random points; only when the points are inconclusive
   (domain errors) does ``sympy.simplify(a - b) == 0`` decide. Equations compare
   ``lhs - rhs`` up to sign.

Never hang, never raise: there is no wall-clock timeout (threads cannot be stopped and
signals only work on the main thread), so inputs are bounded instead: symbolic parsing only
for answers of at most ``MAX_SYMBOLIC_CHARS`` characters and nesting ``MAX_DEPTH``; at most
five variables; numeric powers of at most ``MAX_POWER_DIGITS`` digits; towers of exponentials
with a variable exponent at most ``MAX_TOWER`` high (x^{x^{x^x}} at x = 2.7 stalls evalf);
factorials of at most ``MAX_FACTORIAL``; sequences of at most ``MAX_ELEMENTS`` elements;
simplify only for small expressions (``sympy.count_ops`` at most ``MAX_SIMPLIFY_OPS``, constant
exponents at most ``MAX_SIMPLIFY_POWER``). Values are compared in sympy arithmetic (no float
underflow: 1e-20 is not 0); a value that cancellation left without significant digits
(sin(pi) -> 0.e-152) counts as a zero known up to that magnitude. Every public function turns
garbage (any ``str()``-able input) into None / False / "" instead of raising (bad `style` or
`fallback` arguments are the caller's error and raise ValueError). Results are memoised (the
same answers recur across a prompt's group of completions).
"""

from __future__ import annotations

import math
import random
import re
from fractions import Fraction
from functools import lru_cache
from typing import Any, Optional

__all__ = [
    "STYLES", "FALLBACKS", "extract_answer", "extract_final", "extract_gsm8k", "extract_boxed",
    "last_number", "normalize_answer", "parse_number", "is_equivalent", "symbolic_available",
]

STYLES = ("gsm8k", "math", "auto")
FALLBACKS = (None, "last_number")

MAX_SYMBOLIC_CHARS = 200
MAX_DEPTH = 60
MAX_ELEMENTS = 32
MAX_POWER_DIGITS = 2000
MAX_FACTORIAL = 500
MAX_TOWER = 2
MAX_SIMPLIFY_OPS = 20
MAX_SIMPLIFY_POWER = 4
_TINY = 1e-20
MAX_NORMALIZE_CHARS = 2000
REL_TOL = 1e-6

# ---------------------------------------------------------------------------- extraction


def extract_answer(text: Any, style: str = "auto", fallback: Optional[str] = None) -> Optional[str]:
    """The final answer of `text` (a completion or a reference solution), or None."""
    return extract_final(text, style, fallback)[0]


def extract_final(text: Any, style: str = "auto",
                  fallback: Optional[str] = None) -> tuple[Optional[str], bool]:
    """(answer or None, complete): `complete` is False when the answer reaches the end of
    the text, so a cut-off completion may hold only its prefix."""
    try:
        text = "" if text is None else str(text)
        if style not in STYLES:
            raise ValueError(f"style={style!r} is not one of {STYLES}")
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback={fallback!r} is not one of {FALLBACKS}")
        hash_at, box_at = text.rfind("####"), _last_box_start(text)
        if style == "gsm8k":
            order = ("hash", "box")
        elif style == "math":
            order = ("box", "hash")
        else:
            order = ("hash", "box") if hash_at > box_at else ("box", "hash")
        for marker in order:
            found = _gsm8k(text) if marker == "hash" else _boxed(text)
            if found is not None:
                return found
            if (hash_at if marker == "hash" else box_at) >= 0:
                return None, False  # the last marker holds no answer: no older one is used
        if fallback == "last_number":
            return _last_number(text)
        return None, False
    except ValueError:
        raise
    except Exception:
        return None, False


def _first_found(find, text: Any) -> Optional[str]:
    """``find(text)[0]`` (an extractor's answer), or None when it finds nothing or fails."""
    try:
        found = find(str(text)) if text is not None else None
        return found[0] if found else None
    except Exception:
        return None


def extract_gsm8k(text: Any) -> Optional[str]:
    """The first non-empty line after the last "####", stripped; None without one."""
    return _first_found(_gsm8k, text)


def extract_boxed(text: Any) -> Optional[str]:
    r"""Content of the last ``\boxed{...}`` / ``\fbox{...}`` (balanced braces), or None."""
    return _first_found(_boxed, text)


def last_number(text: Any) -> Optional[str]:
    """The last number in `text` ("1,000", "-3.5", "3/4"), or None."""
    try:
        return _last_number(str(text))[0] if text is not None else None
    except Exception:
        return None


def _gsm8k(text: str) -> tuple[Optional[str], bool] | None:
    at = text.rfind("####")
    if at < 0:
        return None
    rest = text[at + 4:].lstrip()
    line, newline, after = rest.partition("\n")
    answer = line.strip()
    if not answer:
        return None
    return answer, bool(newline)


_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _last_box_start(text: str) -> int:
    starts = [m.start() for m in _BOX_RE.finditer(text)]
    return starts[-1] if starts else -1


def _boxed(text: str) -> tuple[Optional[str], bool] | None:
    at = _last_box_start(text)
    if at < 0:
        return None
    i = at + (6 if text.startswith("\\boxed", at) else 5)
    j = i
    while j < len(text) and text[j] in " \t":
        j += 1
    if j < len(text) and text[j] == "{":
        depth, k = 0, j
        while k < len(text):
            ch = text[k]
            if ch == "\\":
                k += 2  # an escaped character (\{, \}) never opens or closes the box
                continue
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    content = text[j + 1:k].strip()
                    return (content, True) if content else None
            k += 1
        return None  # unclosed: cut off
    if j > i:  # "\boxed 5": up to whitespace or "$"
        m = re.match(r"[^\s$]+", text[j:])
        if m:
            return m.group(0), j + m.end() < len(text)
    return None


_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _last_number(text: str) -> tuple[Optional[str], bool]:
    last = None
    for last in _NUMBER_RE.finditer(text):
        pass
    if last is None:
        return None, False
    return last.group(0), last.end() < len(text)


# ---------------------------------------------------------------------------- normalisation

_UNICODE = {"\u2212": "-", "\u2013": "-", "\u00d7": r"\times ", "\u22c5": r"\cdot ", "\u00b7": r"\cdot ",
            "\u03c0": r"\pi ", "\u221a": r"\sqrt", "\u221e": r"\infty ", "\u00f7": "/", "\u2264": r"\leq ",
            "\u2265": r"\geq ", "\u00b0": "", "\u00a0": " ", "\u2009": " ", "\u202f": " "}
_DROP = [r"\displaystyle", r"\left", r"\right", r"\!", r"\,", r"\;", r"\:", r"\quad", r"\qquad",
         r"\bigl", r"\bigr", r"\Bigl", r"\Bigr", r"\big", r"\Big"]
_WRAPPERS = ("text", "textbf", "textit", "textrm", "mathrm", "mathbf", "mathit", "mbox", "operatorname", "textnormal")
_MATH_WORDS = {"pi", "sqrt", "sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp", "and", "or",
               "infty", "inf", "oo", "i", "e"}
_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_WORD_RE = re.compile(r"[A-Za-z]{2,}|[A-Za-z]+(?: [A-Za-z]+)+")
_PLAIN_NUMBER_RE = re.compile(r"([-+]?)(\d*)(?:\.(\d*))?")


def normalize_answer(answer: Any, strip_units: bool = True) -> str:
    """Canonical text of an answer (see the module docstring); "" for nothing usable (also
    for text longer than MAX_NORMALIZE_CHARS, which is not a final answer)."""
    try:
        return _normalize(str(answer), strip_units)[0] if answer is not None else ""
    except Exception:
        return ""


def _normalize(s: str, strip_units: bool = True) -> tuple[str, bool]:
    """(normalised text, had a percent sign)."""
    if len(s) > MAX_NORMALIZE_CHARS:
        return "", False
    s = s.strip()
    for k, v in _UNICODE.items():
        s = s.replace(k, v)
    s = s.replace("**", "").replace("\\$", "").replace("$", "")
    s = s.replace("\\(", "").replace("\\)", "").replace("\\[", "").replace("\\]", "")
    s = re.sub(r"\\[dtc]frac(?![A-Za-z])", r"\\frac", s)
    for cmd in _DROP:
        s = re.sub(re.escape(cmd) + r"(?![A-Za-z])", "", s)
    s = s.replace("\\ ", " ").replace("~", " ")
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\\degree", "", s)
    percent = "%" in s
    s = s.replace("\\%", "").replace("%", "")
    s = re.sub(r"\\(?:percent)(?![A-Za-z])", "", s)
    s = _unwrap(s)
    s = s.replace("{,}", ",")
    s = s.strip()
    s = re.sub(r"^(?:the\s+)?(?:final\s+)?answer\s*(?:is\s*:?|:)\s*", "", s, flags=re.I)
    s = re.sub(r"^(?:[A-Za-z]|\\[A-Za-z]+)\s*\\in(?![A-Za-z])\s*", "", s)  # "x \in [0, 1]"
    if s.count("=") == 1 and not re.search(r"[<>]|\\[lg]eq?(?![A-Za-z])", s):
        lhs, rhs = s.split("=")
        if re.fullmatch(r"\s*(?:[A-Za-z](?:_\{?\w+\}?)?|\\[A-Za-z]+)\s*", lhs):
            s = rhs
    s = s.strip().rstrip(".").strip()
    if strip_units:
        s = _strip_units(s)
    if re.fullmatch(r"[A-Za-z]{2,}|[A-Za-z]+(?:\s+[A-Za-z]+)+", s):  # words ("Monday"); "x" is not "X"
        return " ".join(s.lower().split()), percent
    s = re.sub(r"\s+", _space, s).rstrip(".")
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)
    while len(s) >= 2 and s[0] == "{" and s[-1] == "}" and _matching(s, 0) == len(s) - 1:
        s = s[1:-1]
    m = re.fullmatch(r"\(([A-Ea-e])\)", s)
    if m:  # multiple choice "(B)"
        s = m.group(1).upper()
    s = _canonical_number(s)
    return s, percent


def _space(m: re.Match) -> str:
    r"""Whitespace goes, except after a command before a letter ("\cdot z" is not "\cdotz")."""
    before, after = m.string[max(0, m.start() - 40):m.start()], m.string[m.end():m.end() + 1]
    return " " if after.isalpha() and re.search(r"\\[A-Za-z]+$", before) else ""


def _unwrap(s: str) -> str:
    r"""\text{abc} -> abc (balanced braces), for every wrapper command."""
    pattern = re.compile(r"\\(?:" + "|".join(_WRAPPERS) + r")\s*\{")
    for _ in range(50):
        m = pattern.search(s)
        if not m:
            break
        close = _matching(s, m.end() - 1)
        if close < 0:
            s = s[:m.start()] + s[m.end():]
        else:
            s = s[:m.start()] + " " + s[m.end():close] + " " + s[close + 1:]
    return s


def _matching(s: str, open_at: int) -> int:
    """Index of the brace closing the one at `open_at` (escaped braces skipped), or -1."""
    depth, k = 0, open_at
    while k < len(s):
        ch = s[k]
        if ch == "\\":
            k += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return k
        k += 1
    return -1


def _strip_units(s: str) -> str:
    """"18 dollars" -> "18", "5 square cm^2" -> "5": trailing words after something numeric."""
    kept = s.split()
    words = 0
    while len(kept) > 1:
        token = re.sub(r"\^\{?[23]\}?$", "", re.sub(r"[.,;:]$", "", kept[-1]))
        if token and not (re.fullmatch(r"[A-Za-z]{2,}", token) and token.lower() not in _MATH_WORDS):
            break
        words += bool(token)
        kept.pop()
    if words and re.search(r"[\d})\]]$", kept[-1]) and re.search(r"\d", " ".join(kept)):
        return " ".join(kept)
    return s


def _canonical_number(s: str) -> str:
    m = _PLAIN_NUMBER_RE.fullmatch(s)
    if not m or not (m.group(2) or m.group(3)):
        return s
    sign, whole, frac = m.group(1), m.group(2).lstrip("0") or "0", (m.group(3) or "").rstrip("0")
    out = whole + ("." + frac if frac else "")
    return ("-" + out) if sign == "-" and out != "0" else out


# ---------------------------------------------------------------------------- numbers

_INT = r"\d+"
_DEC = r"(?:\d+(?:\.\d*)?|\.\d+)"


def parse_number(s: Any) -> Optional[Fraction]:
    r"""Exact value of a normalised numeric answer ("-3", "2.50", "3/4", "\frac{3}{4}",
    "2\frac{1}{2}", "1.5e3", "1.5\times10^{3}"), or None if it is not one."""
    try:
        return _parse_number(str(s).replace(" ", "")) if s is not None else None
    except Exception:
        return None


def _parse_number(s: str) -> Optional[Fraction]:
    if len(s) > 100:
        return None
    sign = 1
    while s[:1] in ("-", "+"):
        sign, s = (-sign if s[0] == "-" else sign), s[1:]
    if s.startswith("(") and s.endswith(")") and s.count("(") == 1:
        inner = _parse_number(s[1:-1])
        return None if inner is None else sign * inner
    if re.fullmatch(_DEC, s):
        return sign * Fraction(s)
    m = re.fullmatch(rf"({_DEC})[eE]([-+]?\d{{1,4}})", s) or \
        re.fullmatch(rf"({_DEC})(?:\\times|\\cdot|\*|x)10\^\{{?([-+]?\d{{1,4}})\}}?", s)
    if m:
        exp = int(m.group(2))
        if abs(exp) > 1000:
            return None
        return sign * Fraction(m.group(1)) * Fraction(10) ** exp
    m = re.fullmatch(rf"({_DEC})/({_DEC})", s)
    if m:
        den = Fraction(m.group(2))
        return None if den == 0 else sign * Fraction(m.group(1)) / den
    m = re.fullmatch(rf"(\d*)\\frac\{{([-+]?{_DEC})\}}\{{([-+]?{_DEC})\}}", s)
    if m:
        den = Fraction(m.group(3))
        if den == 0:
            return None
        value = Fraction(m.group(2)) / den
        if m.group(1):  # mixed number 2\frac{1}{2} = 5/2
            if value < 0:
                return None
            value += int(m.group(1))
        return sign * value
    return None


def _close(a: Fraction, b: Fraction, rel_tol: float) -> bool:
    if a == b:
        return True
    if a.denominator == 1 and b.denominator == 1:
        return False
    return abs(a - b) <= rel_tol * max(abs(a), abs(b))


# ---------------------------------------------------------------------------- equivalence


def is_equivalent(prediction: Any, reference: Any, rel_tol: float = REL_TOL, symbolic: bool = True) -> bool:
    """Whether two final answers mean the same (see the module docstring). Never raises."""
    if prediction is None or reference is None:
        return False
    try:
        prediction, reference = str(prediction).strip(), str(reference).strip()
        if len(prediction) > MAX_NORMALIZE_CHARS or len(reference) > MAX_NORMALIZE_CHARS:
            return prediction == reference  # not an answer one would normalise: verbatim only
        return _equivalent_cached(prediction, reference, float(rel_tol), bool(symbolic))
    except Exception:
        return False


@lru_cache(maxsize=65536)
def _equivalent_cached(prediction: str, reference: str, rel_tol: float, symbolic: bool) -> bool:
    try:
        p, p_pct = _normalize(prediction)
        r, r_pct = _normalize(reference)
        if not p or not r:
            return False
        if p == r:
            return True
        return _equal_normalized(p, r, p_pct or r_pct, rel_tol, symbolic)
    except Exception:  # RecursionError, MemoryError from sympy, anything: not equivalent
        return False


def _equal_normalized(p: str, r: str, percent: bool, rel_tol: float, symbolic: bool, depth: int = 0) -> bool:
    ps, rs = _sequence(p), _sequence(r)
    if depth > 4:
        return False
    if ps is not None or rs is not None:
        if ps is None or rs is None:
            return False
        (po, pe, pc), (ro, re_, rc) = ps, rs
        if len(pe) != len(re_) or len(pe) > MAX_ELEMENTS:
            return False
        unordered = {po, ro} <= {"", "{"}
        if not unordered and (po, pc) != (ro, rc):
            return False

        def same(a: str, b: str) -> bool:
            return a == b or _equal_normalized(a, b, percent, rel_tol, symbolic, depth + 1)

        if not unordered:
            return all(same(a, b) for a, b in zip(pe, re_))
        left = list(re_)
        for a in pe:
            hit = next((i for i, b in enumerate(left) if same(a, b)), None)
            if hit is None:
                return False
            left.pop(hit)
        return True
    return _scalar_equal(p, r, percent, rel_tol, symbolic)


def _sequence(s: str) -> Optional[tuple[str, list[str], str]]:
    r"""(opening, elements, closing) of "(a,b)", "[a,b)", "\{a,b\}" or "a,b"; None for a scalar."""
    opening = closing = ""
    body = s
    if s.startswith("\\{") and s.endswith("\\}"):
        opening, closing, body = "{", "}", s[2:-2]
    elif len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _close_of(s, 0) == len(s) - 1:
        opening, closing, body = s[0], s[-1], s[1:-1]
    parts = _split_top(body)
    if parts is None or (len(parts) < 2 and opening != "{"):
        return None
    if any(not p for p in parts):
        return None
    return opening, parts, closing


def _close_of(s: str, at: int) -> int:
    """Index where the bracket opened at `at` closes (any of ) ] closes any of ( [)."""
    depth = 0
    for k in range(at, len(s)):
        ch = s[k]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return k
    return -1


def _split_top(body: str) -> Optional[list[str]]:
    parts, depth, start = [], 0, 0
    for k, ch in enumerate(body):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth < 0:
                return None
        elif ch == "," and depth == 0:
            parts.append(body[start:k])
            start = k + 1
    if depth != 0:
        return None
    parts.append(body[start:])
    return parts


def _scalar_equal(p: str, r: str, percent: bool, rel_tol: float, symbolic: bool) -> bool:
    a, b = _parse_number(p), _parse_number(r)
    if a is not None and b is not None:
        if _close(a, b, rel_tol):
            return True
        return percent and (_close(a / 100, b, rel_tol) or _close(a, b / 100, rel_tol))
    if not symbolic or len(p) > MAX_SYMBOLIC_CHARS or len(r) > MAX_SYMBOLIC_CHARS:
        return False
    if _WORD_RE.fullmatch(p) or _WORD_RE.fullmatch(r):
        return False  # words compare as text: "no" is not "on", though n*o == o*n
    if (p.count("=") == 1) != (r.count("=") == 1):
        return False
    sympy = _sympy()
    if sympy is None:
        return False
    if "=" in p:
        pl, pr = (to_sympy(x) for x in p.split("="))
        rl, rr = (to_sympy(x) for x in r.split("="))
        if None in (pl, pr, rl, rr):
            return False
        d1, d2 = pl - pr, rl - rr
        return _sym_equal(d1, d2, rel_tol) or _sym_equal(d1, -d2, rel_tol)
    ea, eb = to_sympy(p), to_sympy(r)
    if ea is None or eb is None:
        return False
    if _sym_equal(ea, eb, rel_tol):
        return True
    if percent:
        return _sym_equal(ea / 100, eb, rel_tol) or _sym_equal(ea, eb / 100, rel_tol)
    return False


# ---------------------------------------------------------------------------- symbolic

_SYMPY: Any = None


def _sympy() -> Any:
    global _SYMPY
    if _SYMPY is None:
        try:
            # optional dependency: sympy, only for symbolic answers
            import sympy

            _SYMPY = sympy
        except Exception:
            _SYMPY = False
    return _SYMPY or None


def symbolic_available() -> bool:
    """Whether sympy can be imported (symbolic equivalence is skipped without it)."""
    return _sympy() is not None


def _sym_equal(a: Any, b: Any, rel_tol: float) -> bool:
    sympy = _sympy()
    if a == b:
        return True
    if a.has(sympy.zoo, sympy.nan) or b.has(sympy.zoo, sympy.nan):
        return False
    if a.has(sympy.oo, -sympy.oo) or b.has(sympy.oo, -sympy.oo):
        return False  # infinities are equal only structurally (checked above)
    free = sorted(a.free_symbols | b.free_symbols, key=str)
    if len(free) > 5:
        return False
    if not free:
        same = _compare_at(a, b, {}, rel_tol)
        return same if same is not None else _simplifies_to_zero(a, b)
    rng = random.Random(20260101)
    agree = 0
    for _ in range(5):
        point = {s: sympy.Float(rng.uniform(0.3, 2.7), 20) for s in free}
        same = _compare_at(a, b, point, 1e-8)
        if same is False:
            return False
        agree += same is True
    if agree >= 3:
        return True
    return _simplifies_to_zero(a, b)


def _compare_at(a: Any, b: Any, point: dict, rel_tol: float) -> Optional[bool]:
    """Whether a and b agree at `point`: True, False, or None (cannot tell: a domain error, or
    a value without significant digits that the other value does not rule out)."""
    va, vb = _value(a, point), _value(b, point)
    if va is None or vb is None:
        return None
    (va, ia), (vb, ib) = va, vb
    if not ia and not ib:
        return _complex_close(va, vb, rel_tol)
    try:  # an imprecise value is a zero known up to its magnitude ("0.e-152": |v| < 1e-152)
        bound = max(abs(va) if ia else 0, abs(vb) if ib else 0)
        other = abs(vb) if ia and not ib else abs(va) if ib and not ia else 0
        if other > 1000 * bound:
            return False
        return True if bound < _TINY else None
    except Exception:
        return None


def _simplifies_to_zero(a: Any, b: Any) -> bool:
    """sympy.simplify(a - b) == 0, only for small expressions without big powers."""
    sympy = _sympy()
    if sympy.count_ops(a) + sympy.count_ops(b) > MAX_SIMPLIFY_OPS or _big_powers(a) or _big_powers(b):
        return False
    try:
        return sympy.simplify(a - b) == 0
    except Exception:
        return False


def _big_powers(e: Any) -> bool:
    """Whether `e` has a power with a constant exponent above MAX_SIMPLIFY_POWER (simplify
    might expand it)."""
    sympy = _sympy()
    for p in e.atoms(sympy.Pow):
        if not p.exp.free_symbols:
            m = _magnitude(p.exp)
            if m is None or m > MAX_SIMPLIFY_POWER:
                return True
    return False


def _magnitude(e: Any) -> Optional[float]:
    """|value| of a constant expression, or None if it cannot be evaluated to a finite number."""
    try:
        with _sympy().evaluate(True):  # the parser builds under evaluate(False)
            value = abs(complex(e.evalf(15)))
    except Exception:
        return None
    return value if math.isfinite(value) else None


def _value(e: Any, point: dict) -> Optional[tuple[Any, bool]]:
    """(`e` at `point` to 30 digits as a sympy number, whether it lacks significant digits),
    or None when it is not a finite number. Sympy numbers: no float under- or overflow."""
    sympy = _sympy()
    try:
        v = e.evalf(30, subs=point) if point else e.evalf(30)
        if v.free_symbols or v.has(sympy.oo, -sympy.oo, sympy.zoo, sympy.nan) or not v.is_number:
            return None
        # cancellation can leave no significant digits: sin(pi) -> 0.e-152, x^1000 - x^1000 -> 0.e+234
        return v, any(f._prec < 40 for f in v.atoms(sympy.Float))
    except Exception:
        return None


def _complex_close(a: Any, b: Any, rel_tol: float) -> bool:
    """|a - b| <= rel_tol * max(|a|, |b|), in sympy arithmetic; no absolute floor (1e-20 is not 0)."""
    try:
        return bool(abs((a - b).evalf(30)) <= rel_tol * max(abs(a.evalf(30)), abs(b.evalf(30))))
    except Exception:
        return False


_TOKEN_RE = re.compile(r"\s*(?:(\d+\.\d*|\.\d+|\d+)|(\\[A-Za-z]+)|([A-Za-z])|(_\{[A-Za-z0-9]+\}|_[A-Za-z0-9])|(.))")
_FUNCS = {"sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh",
          "log", "ln", "exp"}
_GREEK = {"alpha", "beta", "gamma", "delta", "theta", "phi", "varphi", "lambda", "mu", "sigma", "omega", "tau",
          "rho", "epsilon", "varepsilon", "psi", "eta", "kappa", "nu", "xi", "zeta", "chi"}


def to_sympy(s: str) -> Any:
    """A sympy expression for a normalised LaTeX-ish answer, or None (not parsed, too big)."""
    sympy = _sympy()
    if sympy is None or not s or len(s) > MAX_SYMBOLIC_CHARS:
        return None
    try:
        tokens = _tokenize(s)
        if tokens is None:
            return None
        parser = _Parser(tokens, sympy)
        # Unevaluated trees: sympy's automatic evaluation runs assumption queries that can
        # take seconds ("sqrt((sin((y+z)**17)+2)**7)"); evalf and simplify evaluate later.
        with sympy.evaluate(False):
            expr = parser.expr(0)
        if parser.pos != len(tokens) or _growth(expr, sympy) > MAX_TOWER:
            return None
        return expr
    except (_ParseError, RecursionError, ValueError, TypeError, ZeroDivisionError, OverflowError,
            AttributeError, IndexError):
        return None
    except Exception:
        return None


class _ParseError(Exception):
    pass


def _growth(e: Any, sympy: Any) -> int:
    """Height of the tower of exponentials with a variable exponent in `e` (x^x: 1,
    x^{x^x}: 2, e^{e^{e^x}}: 3). Evaluating a taller one at x = 2.7 needs numbers whose
    exponents have millions of digits, which stalls evalf; such answers are refused."""
    if e.is_Atom:
        return 0
    if isinstance(e, sympy.Pow) or isinstance(e, (sympy.exp, sympy.sinh, sympy.cosh)):
        exponent = e.args[-1] if isinstance(e, sympy.Pow) else e.args[0]
        inner = max(_growth(a, sympy) for a in e.args)
        return inner + 1 if exponent.free_symbols else inner
    return max((_growth(a, sympy) for a in e.args), default=0)


def _tokenize(s: str) -> Optional[list[tuple[str, str]]]:
    known = _FUNCS | {"pi", "sqrt"}
    for word in re.finditer(r"(?<![\\A-Za-z])[A-Za-z]{3,}", s):
        if word.group(0).lower() not in known:
            return None  # a word, not a product of variables ("listen" is not "silent")
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(s):
        m = _TOKEN_RE.match(s, pos)
        if not m or m.end() == pos:
            return None
        pos = m.end()
        num, cmd, letter, sub, other = m.groups()
        if num is not None:
            out.append(("num", num))
        elif cmd is not None:
            name = cmd[1:]
            if name in ("cdot", "times", "ast"):
                out.append(("op", "*"))
            elif name == "div":
                out.append(("op", "/"))
            elif name in ("frac", "sqrt", "binom", "pi", "infty") or name in _FUNCS or name in _GREEK:
                out.append(("cmd", name))
            else:
                return None  # unknown command: not an expression we can read
        elif letter is not None:
            out.append(("sym", letter))
        elif sub is not None:
            if not out or out[-1][0] != "sym":
                return None
            out[-1] = ("sym", out[-1][1] + "_" + sub.lstrip("_").strip("{}"))
        else:
            if other.isspace():
                continue
            if other not in "+-*/^()[]{}!":
                return None
            out.append(("op", other))
    return _merge_words(out)


def _merge_words(tokens: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Plain "sqrt", "pi", "sin", "ln" written without a backslash become commands."""
    out: list[tuple[str, str]] = []
    i = 0
    names = sorted(_FUNCS | {"pi", "sqrt"}, key=len, reverse=True)
    while i < len(tokens):
        for name in names:
            n = len(name)
            seg = tokens[i:i + n]
            if len(seg) == n and all(t[0] == "sym" and len(t[1]) == 1 for t in seg) and \
                    "".join(t[1] for t in seg) == name:
                out.append(("cmd", name))
                i += n
                break
        else:
            out.append(tokens[i])
            i += 1
    return out


class _Parser:
    """Recursive descent: expr := term (+|- term)*; term := unary (*|/|implicit unary)*;
    unary := (+|-) unary | postfix (^ unary)?; postfix := atom !*."""

    def __init__(self, tokens: list[tuple[str, str]], sympy: Any) -> None:
        self.t, self.pos, self.sp = tokens, 0, sympy

    def peek(self) -> Optional[tuple[str, str]]:
        return self.t[self.pos] if self.pos < len(self.t) else None

    def take(self, kind: str, value: Optional[str] = None) -> str:
        tok = self.peek()
        if tok is None or tok[0] != kind or (value is not None and tok[1] != value):
            raise _ParseError(f"expected {value or kind}")
        self.pos += 1
        return tok[1]

    def at_op(self, *values: str) -> bool:
        tok = self.peek()
        return tok is not None and tok[0] == "op" and tok[1] in values

    def expr(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise _ParseError("too deep")
        left = self.term(depth)
        while self.at_op("+", "-"):
            op = self.take("op")
            right = self.term(depth)
            left = left + right if op == "+" else left - right
        return left

    def term(self, depth: int) -> Any:
        left = self.unary(depth)
        while True:
            if self.at_op("*", "/"):
                op = self.take("op")
                right = self.unary(depth)
                if op == "/":
                    if right == 0:
                        raise _ParseError("division by zero")
                    left = left / right
                else:
                    left = left * right
            elif self._starts_atom():
                left = left * self.power(depth)
            else:
                return left

    def _starts_atom(self) -> bool:
        tok = self.peek()
        if tok is None:
            return False
        return tok[0] in ("num", "sym", "cmd") or (tok[0] == "op" and tok[1] in "([{")

    def unary(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise _ParseError("too deep")
        if self.at_op("-"):
            self.take("op")
            return -self.unary(depth + 1)
        if self.at_op("+"):
            self.take("op")
            return self.unary(depth + 1)
        return self.power(depth)

    def power(self, depth: int) -> Any:
        base = self.postfix(depth)
        if self.at_op("^"):
            self.take("op")
            exponent = self.unary(depth + 1) if not self.at_op("{") else self.group(depth)
            return self._pow(base, exponent)
        return base

    def _pow(self, base: Any, exponent: Any) -> Any:
        if not exponent.free_symbols:
            e = _magnitude(exponent)
            if e is None or e > 10_000:
                raise _ParseError("exponent too large")
            if not base.free_symbols:
                b = _magnitude(base)
                if b is None or e * math.log10(max(b, 1e-300)) > MAX_POWER_DIGITS:
                    raise _ParseError("power too large")
        return self.sp.Pow(base, exponent)

    def postfix(self, depth: int) -> Any:
        value = self.atom(depth + 1)
        while self.at_op("!"):
            self.take("op")
            if not (value.is_Integer and 0 <= int(value) <= MAX_FACTORIAL):
                raise _ParseError("factorial of a non-integer or too large")
            value = self.sp.factorial(value)
        return value

    def group(self, depth: int) -> Any:
        """{...} or (...) or [...] -> its expression."""
        tok = self.peek()
        if tok is None or tok[0] != "op" or tok[1] not in "({[":
            raise _ParseError("expected a group")
        closing = {"(": ")", "{": "}", "[": "]"}[tok[1]]
        self.take("op")
        value = self.expr(depth + 1)
        self.take("op", closing)
        return value

    def arg(self, depth: int) -> Any:
        r"""Argument of \frac, \sqrt, ^: a braced group or a single token."""
        tok = self.peek()
        if tok is None:
            raise _ParseError("missing argument")
        if tok[0] == "op" and tok[1] in "({":
            return self.group(depth)
        if tok[0] == "num":
            self.pos += 1
            return self._number(tok[1])
        return self.atom(depth + 1)

    def _number(self, text: str) -> Any:
        sp = self.sp
        return sp.Rational(text) if "." in text else sp.Integer(text)

    def atom(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise _ParseError("too deep")
        sp = self.sp
        tok = self.peek()
        if tok is None:
            raise _ParseError("unexpected end")
        kind, value = tok
        if kind == "num":
            self.pos += 1
            return self._number(value)
        if kind == "sym":
            self.pos += 1
            if value == "i":
                return sp.I
            if value == "e":
                return sp.E
            return sp.Symbol(value)
        if kind == "op" and value in "({[":
            return self.group(depth)
        if kind == "cmd":
            self.pos += 1
            if value == "pi":
                return sp.pi
            if value == "infty":
                return sp.oo
            if value in _GREEK:
                return sp.Symbol(value)
            if value == "frac":
                num = self.arg(depth)
                den = self.arg(depth)
                if den == 0:
                    raise _ParseError("division by zero")
                return num / den
            if value == "binom":
                n, k = self.arg(depth), self.arg(depth)
                if not (n.is_Integer and k.is_Integer and 0 <= int(n) <= MAX_FACTORIAL):
                    raise _ParseError("binomial of non-integers or too large")
                return sp.binomial(n, k)
            if value == "sqrt":
                if self.at_op("["):
                    self.take("op")
                    index = self.expr(depth + 1)
                    self.take("op", "]")
                    return self._pow(self.arg(depth), 1 / index)
                return sp.sqrt(self.arg(depth))
            if value in _FUNCS:
                exponent = None
                if self.at_op("^"):  # \sin^2 x
                    self.take("op")
                    exponent = self.arg(depth)
                argument = self.arg(depth) if self.at_op("(", "{") else self.power(depth)
                fn = {"ln": sp.log, "arcsin": sp.asin, "arccos": sp.acos, "arctan": sp.atan}.get(value) \
                    or getattr(sp, value)
                out = fn(argument)
                return out if exponent is None else self._pow(out, exponent)
        raise _ParseError(f"unexpected {value!r}")
