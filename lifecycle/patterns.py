"""Name patterns: checkpoint names with a ``{step}`` placeholder, marker globs.

A checkpoint pattern matches ONE path component (a directory or file name),
never a path: ``step_{step}`` matches ``run1/step_1000/`` at any depth.
``{step}`` stands for a non-negative decimal integer, ``*`` for any run of
characters and ``?`` for a single character; everything else is literal.
"""

from __future__ import annotations

import re

STEP_PLACEHOLDER = "{step}"


class PatternError(ValueError):
    """A pattern is malformed; the message says why (without the setting name)."""


def compile_step_pattern(text: str) -> re.Pattern[str]:
    if not isinstance(text, str) or not text:
        raise PatternError("must be a non-empty string")
    if text.count(STEP_PLACEHOLDER) != 1:
        raise PatternError(f"must contain {STEP_PLACEHOLDER} exactly once, got {text!r}")
    if "/" in text:
        raise PatternError(f"must be a single file or directory name without '/', got {text!r}")
    parts: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith(STEP_PLACEHOLDER, i):
            parts.append(r"(?P<step>[0-9]+)")
            i += len(STEP_PLACEHOLDER)
            continue
        ch = text[i]
        if ch in "{}":
            raise PatternError(f"only the {STEP_PLACEHOLDER} placeholder is supported, got {text!r}")
        if ch == "*":
            # Lazy, so that in "*{step}" the step takes all trailing digits.
            parts.append(r"[^/]*?")
        elif ch == "?":
            parts.append(r"[^/]")
        else:
            parts.append(re.escape(ch))
        i += 1
    return re.compile("".join(parts))


def match_step(pattern: re.Pattern[str], name: str) -> int | None:
    m = pattern.fullmatch(name)
    return int(m.group("step")) if m else None


def check_marker_glob(text: str) -> None:
    if not isinstance(text, str) or not text:
        raise PatternError("must be a non-empty string")
    if "/" in text:
        raise PatternError(f"must be a file name (glob) without '/', got {text!r}")
