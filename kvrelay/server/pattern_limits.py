"""How costly a JSON schema's ``pattern`` may be to compile into a grammar.

xgrammar expands counted repetition (``{m,n}``) into states, and repetition nested in repetition multiplies them:
on a 2-core CPU, ``^[a-z]{1,5000}$`` compiled in 1.5 s and ``^[a-z]{0,20000}$`` in 81 s, while
``^([a-z]{1,10}){1,30}$`` took 10 s and ``^([a-z]{1,50}){1,100}$`` 189 s (a four-character change from a
domain-name pattern). So a pattern is bounded in length, in any one count, and in the product of the counts along
a nesting; common patterns (dates, UUIDs, IPv4 ``(\\d{1,3}\\.){3}\\d{1,3}``, ``^.{1,200}$``) are below
(benchmarks/schema_compile.py).
"""

from __future__ import annotations

import re

MAX_PATTERN_CHARS = 4096
MAX_PATTERN_REPEAT = 1000  # the largest count in one ``{m}``, ``{m,}`` or ``{m,n}``
# the product of the counts of repetition nested in repetition ("." costs most: ``^(.{1,8}){1,8}$`` took 9 s)
MAX_NESTED_REPEAT = 16
_COUNT = re.compile(r"\{(\d+)(?:(,)(\d*))?\}")


def _class_end(pattern: str, i: int) -> int:
    """The index after the character class opening at ``pattern[i]`` ("[")."""
    j = i + 1
    if j < len(pattern) and pattern[j] == "^":
        j += 1
    if j < len(pattern) and pattern[j] == "]":  # a leading "]" is a literal
        j += 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1


def pattern_problem(pattern: str, max_chars: int = MAX_PATTERN_CHARS) -> str | None:
    """Why ``pattern`` (of at most ``max_chars`` characters) is too costly to compile, or None. A pattern this cannot
    parse (unbalanced groups) is left to the grammar compiler, which refuses it."""
    if len(pattern) > max_chars:
        return f"a pattern longer than {max_chars} characters"
    groups = [1]  # per open group: the largest product of counts inside it
    last = 1  # the product of counts inside the atom just read (1 for a character; a group's for a group)
    i = 0
    while i < len(pattern):
        c = pattern[i]
        count = _COUNT.match(pattern, i)
        if count is not None:
            digits = count.group(3) or count.group(1)
            if len(digits) > len(str(MAX_PATTERN_REPEAT)) or int(digits) > MAX_PATTERN_REPEAT:
                return f"a count {count.group(0)} over {MAX_PATTERN_REPEAT} in a pattern"
            product = max(int(digits), 1) * last
            if last > 1 and product > MAX_NESTED_REPEAT:
                return (f"repetition nested in repetition of {product} in a pattern (the counts multiplied; at most "
                        f"{MAX_NESTED_REPEAT})")
            groups[-1] = max(groups[-1], product)
            last, i = 1, count.end()
        elif c == "(":
            groups.append(1)
            last, i = 1, i + 1
        elif c == ")" and len(groups) > 1:
            last = groups.pop()
            groups[-1] = max(groups[-1], last)
            i += 1
        elif c in "*+?":  # keeps ``last``: a count after it (``(a{1,9})*{1,9}``) still repeats the group's counts
            i += 1
        elif c == "[":
            last, i = 1, _class_end(pattern, i)
        else:
            last, i = 1, i + (2 if c == "\\" else 1)
    return None


def total_repeat(text: str) -> int:
    """The counts of every ``{m}``, ``{m,}`` or ``{m,n}`` in ``text`` summed (each its largest bound): a regex's
    or grammar's repetitions side by side each cost their own compile time, nested or not."""
    digits = (m.group(3) or m.group(1) for m in _COUNT.finditer(text))
    return sum(max(int(d), 1) if len(d) <= 9 else 10**9 for d in digits)  # no int() of a 5000-digit count
