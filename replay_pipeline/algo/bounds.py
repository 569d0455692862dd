"""Per-value bounds, stated once: `Bound` says what a number may be and words the refusal.

A bound lives with the value it constrains. Configuration fields declare theirs where they are
declared (`replay_pipeline.config.bounded`); a library component that can be used without the
configuration (the learner, the sampling rules) declares its own as constants, checks them on
construction, and the configuration field of the same value names that constant, so no
bound is written twice. Ground floor: imports nothing of the project.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Bound:
    ge: float | None = None
    """Smallest value allowed (inclusive)."""
    gt: float | None = None
    """Values must be above this (exclusive)."""
    le: float | None = None
    """Largest value allowed (inclusive)."""
    lt: float | None = None
    """Values must be below this (exclusive)."""
    integer: bool = False
    """Only whole numbers (not bools)."""
    finite: bool = False
    """Only finite numbers (no nan, no inf); said in the message."""
    null: str | None = None
    """None is allowed and means this (e.g. "for no cap"); None here: None is refused."""
    hint: str = ""
    """Said after the rule, in parentheses (e.g. "0 disables it")."""

    def rule(self) -> str:
        lo = (f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}") \
            if self.ge is not None or self.gt is not None else None
        hi = (f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})") \
            if self.le is not None or self.lt is not None else None
        if lo and hi:
            text = f"in {lo}, {hi}"
        elif lo:
            text = f">= {_num(self.ge)}" if self.ge is not None else f"> {_num(self.gt)}"
        elif hi:
            text = f"<= {_num(self.le)}" if self.le is not None else f"< {_num(self.lt)}"
        else:
            text = "a number"
        kind = "an integer " if self.integer else "a finite number " if self.finite else ""
        return kind + text

    def problem(self, name: str, value: Any) -> str | None:
        """None if `value` is allowed, else "name=value must be ..." saying what is."""
        if value is None and self.null is not None:
            return None
        if not self._ok(value):
            text = f"{name}={value} must be {self.rule()}"
            if self.null is not None:
                text += f", or null {self.null}"
            return text + (f" ({self.hint})" if self.hint else "")
        return None

    def check(self, name: str, value: Any) -> None:
        """Raise ValueError with `problem`'s words if `value` is not allowed."""
        problem = self.problem(name, value)
        if problem:
            raise ValueError(problem)

    def _ok(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return False
        if self.integer and not isinstance(value, numbers.Integral):
            return False
        if math.isnan(value) or (self.finite and math.isinf(value)):
            return False
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
