"""A Lance SQL predicate of the spec (``data.filter``, ``data.mix[].filter``, ``infer.filter``) is
refused at validation where Lance would read less of it than the user wrote.

Lance parses a filter as ``SELECT ... WHERE <filter>`` and keeps the first statement, silently: a
``;`` ends the predicate (``x > 3; x < 2`` selects ``x > 3``), and so does a ``)`` that closes no
``(`` (``x > 3) OR (x < 1`` selects ``x > 3``). A job would then train on, or write values into,
other rows than the spec says. The check reads the text as SQL does: ``;`` and parentheses inside
a string literal (``'a;b'``), a quoted identifier (``"a)"``, ```a)```) or a comment are text.
"""

from __future__ import annotations

QUOTES = {"'": "string literal", '"': "quoted identifier", "`": "quoted identifier"}
QUOTE_FIX = "close it; a quote inside a literal is written twice ('it''s')"


def check_predicate(predicate: str | None) -> str | None:
    """A pydantic validator: ``predicate`` unchanged, or a ValueError saying what Lance would cut."""
    problem = predicate_problem(predicate) if predicate is not None else None
    if problem is not None:
        message, fix = problem
        raise ValueError(f"{message}\n  fix: {fix}")
    return predicate


def predicate_problem(predicate: str) -> tuple[str, str] | None:
    """(what is wrong, how to fix it) where Lance would cut ``predicate`` short, else None."""
    depth = 0
    index = 0
    while index < len(predicate):
        char = predicate[index]
        if char in QUOTES:
            end = _closing_quote(predicate, index)
            if end < 0:
                return f"the {QUOTES[char]} opened by {char} at character {index + 1} is never closed", QUOTE_FIX
            index = end
        elif predicate.startswith("--", index):
            index = _end_of(predicate, "\n", index + 2)
        elif predicate.startswith("/*", index):
            opened, index = index, _end_of(predicate, "*/", index + 2)
            if index < 0:
                return f"the comment opened at character {opened + 1} is never closed", "close it with */"
        elif char == ";":
            return (
                f"has ';' at character {index + 1}: Lance would read only what comes before it, silently",
                "write one predicate: join conditions with AND or OR; quote a ';' that is text: name = 'a;b'",
            )
        elif char in "()":
            depth += 1 if char == "(" else -1
            if depth < 0:
                return (
                    f"the ')' at character {index + 1} closes no '(': Lance would read only what comes before it, silently",
                    "balance the parentheses; quote a parenthesis that is text: name = 'a)'",
                )
        index += 1
    if depth > 0:
        return f"has {depth} '(' never closed", "balance the parentheses; quote a parenthesis that is text: name = '(a'"
    return None


def _closing_quote(text: str, start: int) -> int:
    """The index of the quote that closes the one at ``start`` (a doubled quote is text), or -1."""
    quote = text[start]
    index = start + 1
    while (index := text.find(quote, index)) >= 0:
        if not text.startswith(quote * 2, index):
            return index
        index += 2
    return -1


def _end_of(text: str, closing: str, start: int) -> int:
    """The index of the last character of ``closing`` after ``start``; the end of ``text`` for a
    line comment's newline, -1 for a block comment never closed."""
    found = text.find(closing, start)
    if found < 0:
        return len(text) if closing == "\n" else -1
    return found + len(closing) - 1
