"""Boxed answers and verl 0.9.1's MATH scorer (`verl/utils/reward_score/math_reward.py`, from
lm-evaluation-harness's hendrycks_math), with its normalisation steps as public functions.

`scorers` re-exports `last_boxed_only_string`, `remove_boxed`, `strip_math_string`,
`math_is_equiv` and `math_score` (its module docstring lists the quirks kept); the PRIME math and
Geometry3K graders (prm800k.py, prime_math.py) reuse the normalisation steps, so they live here,
below every scorer module that needs them.
"""

from __future__ import annotations

import logging

_log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Boxed answers, shared by MATH and DAPO.


def closing_brace(text: str, start: int) -> int | None:
    """Index of the "}" that brings the brace depth, counted from text[start], back to 0.

    verl's scan: a "}" before any "{" drives the depth negative, and only a "}" that lands on
    exactly 0 ends the scan, so "\\boxed}{}" has no end.
    """
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def last_boxed_only_string(text: str) -> str | None:
    """The last `\\boxed` (or, without any `\\boxed`, `\\fbox`) group of `text`, command included.

    verl's math_reward.last_boxed_only_string: if `\\boxed ` (with a space) occurs anywhere, the
    result is `\\boxed ` plus the text after its last occurrence up to the next "$". Otherwise the
    group runs from the last `\\boxed` (or `\\fbox`) to the brace that closes the first "{" after
    it, whatever stands between them.

    Returns:
      e.g. "\\boxed{\\frac{1}{2}}", or None when there is no box or it never closes.
    """
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    end = closing_brace(text, start)
    return None if end is None else text[start : end + 1]


def remove_boxed(boxed: str) -> str:
    """The content of "\\boxed{...}" or "\\boxed ..." (verl's math_reward.remove_boxed).

    Raises:
      ValueError: for anything else, including "\\fbox{...}" (verl: AssertionError).
    """
    if "\\boxed " in boxed:
        if not boxed.startswith("\\boxed "):
            raise ValueError(f"not a '\\boxed ' answer: {boxed!r}")
        return boxed[len("\\boxed ") :]
    if not (boxed.startswith("\\boxed{") and boxed.endswith("}")):
        raise ValueError(f"not a '\\boxed{{...}}' answer: {boxed!r}")
    return boxed[len("\\boxed{") : -1]


# ---------------------------------------------------------------------------------------------
# MATH (verl/utils/reward_score/math_reward.py, from lm-evaluation-harness hendrycks_math).


def fix_fracs(s: str) -> str:
    """Braces shorthand fractions: "\\frac12" -> "\\frac{1}{2}", "\\frac1{72}" -> "\\frac{1}{72}".

    verl's fix_fracs: a "\\frac" followed by one character that is not "{" leaves the whole
    string unchanged.

    Raises:
      ValueError: when a "\\frac" is followed directly by another one or ends the string (verl
        indexes an empty string there).
    """
    head, *tails = s.split("\\frac")
    out = [head]
    for tail in tails:
        if not tail:
            raise ValueError(f"'\\frac' without arguments in {s!r}")
        if tail[0] == "{":
            out.append("\\frac" + tail)
            continue
        if len(tail) < 2:
            return s
        numerator, second, rest = tail[0], tail[1], tail[2:]
        if second == "{":  # "\\frac1{72}": only the numerator lacks braces
            out.append("\\frac{" + numerator + "}" + second + rest)
        else:
            out.append("\\frac{" + numerator + "}{" + second + "}" + rest)
    return "".join(out)


def fix_a_slash_b(s: str) -> str:
    """Rewrites "3/4" as "\\frac{3}{4}" when both sides are ints that print back unchanged.

    verl's fix_a_slash_b.
    """
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        numerator, denominator = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    # int() accepts " 3", "+3", "03", "3_0": verl then rejects them by printing the ints back.
    if f"{numerator}/{denominator}" != s:
        return s
    return "\\frac{" + str(numerator) + "}{" + str(denominator) + "}"


def remove_right_units(s: str) -> str:
    """Drops a unit written as "\\text{ unit}" and everything after it (remove_right_units).

    Raises:
      ValueError: when "\\text{ " occurs more than once (verl asserts exactly one).
    """
    if "\\text{ " not in s:
        return s
    parts = s.split("\\text{ ")
    if len(parts) != 2:
        raise ValueError(f"more than one '\\text{{ ' unit in {s!r}")
    return parts[0]


def fix_sqrt(s: str) -> str:
    """Braces the one character after each "\\sqrt": "\\sqrt3" -> "\\sqrt{3}" (verl's fix_sqrt).

    Raises:
      ValueError: when a "\\sqrt" is followed directly by another one or ends the string.
    """
    if "\\sqrt" not in s:
        return s
    head, *tails = s.split("\\sqrt")
    out = [head]
    for tail in tails:
        if not tail:
            raise ValueError(f"'\\sqrt' without an argument in {s!r}")
        if tail[0] == "{":
            out.append("\\sqrt" + tail)
        else:
            out.append("\\sqrt{" + tail[0] + "}" + tail[1:])
    return "".join(out)


def strip_math_string(s: str, *, percents: tuple[str, ...] = ("\\\\%", "\\%")) -> str:
    """Hendrycks MATH answer normalisation, step for step as verl's math_reward.strip_string.

    The order matters (e.g. spaces are removed only after "\\sqrt x" became "\\sqrt{x}"), so the
    steps below are verl's, in verl's order. `percents`: the percent markers removed, in order
    (mathruler's copy of these steps removes "\\%" then a bare "%": prm800k.py).

    Raises:
      ValueError: where verl's strip_string raises (two "\\text{ " units, or a bare trailing or
        doubled "\\frac" / "\\sqrt"); `math_is_equiv` then compares the raw strings.
    """
    s = s.replace("\n", "").replace("\\!", "")
    s = s.replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")  # degrees
    s = s.replace("\\$", "")
    s = remove_right_units(s)
    for mark in percents:
        s = s.replace(mark, "")
    # " .5" and "{.5" read as " 0.5" and "{0.5"; a leading "." gets its 0 below.
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    # "k = 3" -> " 3": a short left-hand side of the only "=" is taken for a variable name.
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = fix_sqrt(s)
    s = s.replace(" ", "")
    s = fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return fix_a_slash_b(s)


def math_is_equiv(answer: str | None, ground_truth: str | None) -> bool:
    """verl's math_reward.is_equiv: equal after `strip_math_string`, or raw-equal when it fails.

    Two Nones are equal; one None is not.
    """
    if answer is None or ground_truth is None:
        return answer is None and ground_truth is None
    try:
        return strip_math_string(answer) == strip_math_string(ground_truth)
    except Exception:  # noqa: BLE001 - verl falls back on any failure (also non-str inputs)
        return answer == ground_truth


def math_score(solution_str: str, ground_truth: str) -> float:
    """verl's math_reward.compute_score: 1.0 when the last boxed answer is equivalent, else 0.0.

    Args:
      solution_str: the decoded completion.
      ground_truth: the reference answer, not boxed (e.g. "\\frac{1}{2}").

    Returns:
      1.0 or 0.0; 0.0 also when anything raises (an fbox, a malformed box), as in verl.
    """
    try:
        boxed = last_boxed_only_string(solution_str)
        if boxed is None:
            return 0.0
        return 1.0 if math_is_equiv(remove_boxed(boxed), ground_truth) else 0.0
    except Exception as e:  # noqa: BLE001 - verl prints the error and scores 0
        _log.debug("math_score: scored 0 after %r", e)
        return 0.0
