"""The PRM800K answer grader (openai/prm800k `grading/grader.py`), as verl 0.9.1 runs it twice.

`grade_answer(given, ground_truth)` is True when the two answers are equal after the MATH
("mathd") normalisation, or after PRM800K's own normalisation, or, element by element for tuples
and intervals, when sympy simplifies their difference to 0. verl reaches it through two copies
that differ in small ways, selected here by `variant`:

* "prime_math": `verl/utils/reward_score/prime_math/grader.py` + `math_normalize.py` (the
  numina_* sources, `grpo_jax.rewards.prime_math`). Its mathd normalisation is exactly
  `math_reward.strip_math_string` (the same lm-evaluation-harness code as verl's math_reward);
  its unit list includes "liter"; spaces and braces survive the PRM800K normalisation; the sympy
  check runs in a forked process with a 10 s timeout (a timeout scores False).
* "mathruler": mathruler 0.1.0's `mathruler/grader.py` + `math_normalize.py` (geometry3k,
  `grpo_jax.rewards.geo3k`). Its mathd normalisation removes "\\%" then every "%" where
  prime_math removes "\\\\%" then "\\%"; its unit list has no "liter"; after the mixed-number
  step it removes spaces and any "{" or "}"; the sympy check has no timeout.

Quirks shared by both, kept:

* Units are removed as regexes anywhere in the string, also inside words ("seconds" in
  "milliseconds", "day" in "Monday", "cm" in "\\mathrm{cm}"), plural forms and a "^2" included.
* A text answer is lower-cased; "million" becomes "*10^6"; " and " / " or " become " , ".
* The sympy check only runs when the expression `(gt)-(given)` has at most two distinct letters
  besides "sqrt" and "frac", and no "^{", "^(", "^<digits>^" or two-digit exponent; it parses with
  implicit multiplication ("2x" = 2*x) and "^" as power.
* Two fractions "a/b" are compared as strings (an unreduced fraction is wrong); an integer
  ground truth needs an integer answer (no sympy).
* Tuples/intervals: brackets must match when the ground truth has several elements.

Differences from verl, both about time, never about a score that finishes: the sympy check runs
in-process without a timeout (the caller's worker timeout bounds it, see pool.py), so it works in
any thread; where verl's forked check would time out after 10 s and score False, this one runs
to completion (or the caller's timeout). sympy and pylatexenc are imported on first use, and
their versions matter (pylatexenc's latex2text output, sympy's simplify): requirements.txt pins
the ones verl's venv has.
"""

from __future__ import annotations

import re

from grpo_jax.rewards import math_reward

VARIANTS = ("prime_math", "mathruler")

# sympy might hang: PRM800K does not try to be lenient on these (verl's BAD_SUBSTRINGS/REGEXES).
_BAD_SUBSTRINGS = ("^{", "^(")
_BAD_REGEXES = tuple(re.compile(p) for p in (r"\^[0-9]+\^", r"\^[0-9][0-9]+"))
_TUPLE_CHARS = "()[]"
_TEXT_RE = re.compile(r"^\\text\{(?P<text>.+?)\}$")  # "$" also matches before a final "\n"
_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day",
          "week", "month", "year", "foot", "feet", "inch", "yard")  # fmt: skip
_UNIT_RES = {
    "mathruler": tuple(re.compile(rf"{u}(es)?(s)? *(\^[0-9]+)?") for u in _UNITS),
    "prime_math": tuple(re.compile(rf"{u}(es)?(s)? *(\^[0-9]+)?") for u in _UNITS + ("liter",)),
}
_CIRC_RE = re.compile(r"\^ *\\circ")
_THOUSANDS_RE = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_MIXED_NUMBER_RE = re.compile(r"([0-9]) +([0-9])")
_FRAC_RE = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
# latex2text's symbols, spelled the way sympy's parser reads them.
_LATEX2TEXT_SYMBOLS = (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*"))


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


# ---------------------------------------------------------------------------------------------
# The MATH ("mathd") normalisation, both copies.


def _strip_mathruler(s: str) -> str:
    """mathruler's _strip_string: `math_reward.strip_math_string` except for the percent step
    (prime_math's copy removes "\\\\%" then "\\%", mathruler's "\\%" then "%")."""
    return math_reward.strip_math_string(s, percents=("\\%", "%"))


def mathd_normalize(answer: str | None, *, variant: str) -> str | None:
    """math_normalize.normalize_answer: strip, unwrap a whole `\\text{...}`, MATH normalisation.

    When the normalisation raises (see `math_reward.strip_math_string`) the stripped, unwrapped
    answer is returned as is.
    """
    _check_variant(variant)
    if answer is None:
        return None
    answer = answer.strip()
    try:
        m = _TEXT_RE.search(answer)
        if m is not None:
            answer = m.group("text").strip()
        if variant == "prime_math":
            return math_reward.strip_math_string(answer)
        return _strip_mathruler(answer)
    except Exception:  # noqa: BLE001 - verl returns the answer on any failure
        return answer


# ---------------------------------------------------------------------------------------------
# PRM800K's normalisation.


def _is_float(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _is_int(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except Exception:  # noqa: BLE001 - inf and nan are not ints
        return False


def _strip_thousands_commas(expr: str) -> str:
    """Removes commas that group thousands ("1,000,000"), keeping tuple commas ("1,2")."""
    while True:
        next_expr = _THOUSANDS_RE.sub(r"\1\3\4", expr)
        if next_expr == expr:
            return next_expr
        expr = next_expr


def _str_is_int(x: str) -> bool:
    try:
        value = float(_strip_thousands_commas(x))
        return abs(value - int(round(value))) <= 1e-7
    except Exception:  # noqa: BLE001 - not a number, inf or nan
        return False


def _import_latex2text():
    try:
        from pylatexenc import latex2text
    except ImportError as e:
        raise ImportError(
            "the PRM800K grader needs pylatexenc (verl's venv has 2.11): pip install pylatexenc"
        ) from e
    return latex2text


def _parse_latex(expr: str, latex2text) -> str:
    """LaTeX -> text that sympy reads, through pylatexenc's latex2text."""
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    expr = expr.replace("\\frac", " \\frac")  # mixed numbers: "1\\frac12" -> "1 1/2"
    expr = latex2text.LatexNodes2Text().latex_to_text(expr)
    for symbol, name in _LATEX2TEXT_SYMBOLS:
        expr = expr.replace(symbol, name)
    return expr.strip()


def normalize(expr: str | None, *, variant: str) -> str | None:
    """PRM800K's _normalize (see the module doc for what each variant does)."""
    _check_variant(variant)
    if expr is None:
        return None
    m = _TEXT_RE.search(expr)
    if m is not None:
        expr = m.group("text")
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    expr = expr.replace("million", "*10^6").replace("billion", "*10^9")
    expr = expr.replace("trillion", "*10^12")
    for unit_re in _UNIT_RES[variant]:
        expr = unit_re.sub("", expr)
    expr = _CIRC_RE.sub("", expr)
    if len(expr) > 0 and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(",\\\\! *", "", expr)
    if _is_float(expr) and _is_int(float(expr)):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        latex2text = _import_latex2text()  # outside the try: a missing package must not pass
        try:
            expr = _parse_latex(expr, latex2text)
        except Exception:  # noqa: BLE001 - verl keeps the LaTeX when pylatexenc fails
            pass
    expr = re.sub("- *", "-", expr)  # mixed numbers and negative signs
    expr = _MIXED_NUMBER_RE.sub(r"\1+\2", expr)  # "7 3/4" -> "7+3/4"
    if variant == "mathruler":
        expr = expr.replace(" ", "").replace("{", "").replace("}", "")
    expr = expr.lower()
    if _str_is_int(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


# ---------------------------------------------------------------------------------------------
# The sympy check and the grader.


def _should_allow_eval(expr: str) -> bool:
    """PRM800K's guard: at most two unknown letters, no exponent patterns that make sympy hang."""
    letters = {ch for ch in expr.replace("sqrt", "").replace("frac", "") if ch.isalpha()}
    if len(letters) > 2:
        return False
    if any(bad in expr for bad in _BAD_SUBSTRINGS):
        return False
    return all(bad_re.search(expr) is None for bad_re in _BAD_REGEXES)


def are_equal_under_sympy(ground_truth_normalized: str, given_normalized: str) -> bool:
    """True when sympy simplifies `(gt)-(given)` to 0; False when not allowed or on any error."""
    from sympy import simplify
    from sympy.parsing import sympy_parser

    expr = f"({ground_truth_normalized})-({given_normalized})"
    try:
        if not _should_allow_eval(expr):
            return False
        transformations = sympy_parser.standard_transformations + (
            sympy_parser.implicit_multiplication_application,
        )
        diff = sympy_parser.parse_expr(expr.replace("^", "**"), transformations=transformations)
        return bool(simplify(diff) == 0)
    except Exception:  # noqa: BLE001 - PRM800K: a parse or simplify failure is "not equal"
        return False


def split_tuple(expr: str) -> list[str]:
    """The elements of "(a,b)" / "[a,b)" (one level of brackets); [expr] for anything else."""
    expr = _strip_thousands_commas(expr)
    if len(expr) == 0:
        return []
    if (
        len(expr) > 2
        and expr[0] in _TUPLE_CHARS
        and expr[-1] in _TUPLE_CHARS
        and all(ch not in expr[1:-1] for ch in _TUPLE_CHARS)
    ):
        return [elem.strip() for elem in expr[1:-1].split(",")]
    return [expr]


def grade_answer(given_answer: str | None, ground_truth: str, *, variant: str) -> bool:
    """PRM800K's grade_answer: mathd-equal, PRM800K-equal, or sympy-equal element by element."""
    _check_variant(variant)
    if given_answer is None:
        return False
    if mathd_normalize(ground_truth, variant=variant) == mathd_normalize(
        given_answer, variant=variant
    ):
        return True
    gt_norm = normalize(ground_truth, variant=variant)
    given_norm = normalize(given_answer, variant=variant)
    if gt_norm is None:
        return False
    if gt_norm == given_norm:
        return True
    if len(given_norm) == 0:
        return False
    gt_elems, given_elems = split_tuple(gt_norm), split_tuple(given_norm)
    if len(gt_elems) > 1 and (gt_norm[0] != given_norm[0] or gt_norm[-1] != given_norm[-1]):
        return False
    if len(gt_elems) != len(given_elems):
        return False
    for gt_elem, given_elem in zip(gt_elems, given_elems, strict=True):
        if _FRAC_RE.search(gt_elem) and _FRAC_RE.search(given_elem):
            equal = gt_elem == given_elem  # an unreduced fraction is wrong: no sympy
        elif _str_is_int(gt_elem) != _str_is_int(given_elem):
            equal = False  # an integer ground truth needs an integer answer
        else:
            equal = are_equal_under_sympy(gt_elem, given_elem)
        if not equal:
            return False
    return True
