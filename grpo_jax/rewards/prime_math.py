"""PRIME's math scorer: verl 0.9.1's `verl/utils/reward_score/prime_math/__init__.py` (numina_*).

`prime_math_score(completion, ground_truth)` returns verl's triple (correct, format_ok, answer):
the answer is cut out of the completion by `match_answer`, graded by the PRM800K grader
(`prm800k.grade_answer`, variant "prime_math"), and, when that fails, by ToRA's `math_equal`.
`default_compute_score` keeps only the first entry, as a float. Quirks kept:

* `match_answer` takes the text after the last "answer:" / "answer is" / "answers are" (case
  insensitive, each searched in what the previous one left), before the last "is answer" / "is
  the answer" / ..., then the content of the last `\\boxed{...}` (or, without a `\\boxed`, the last
  `\\fbox{...}`), then the text before the last ". ", then the text after the last "be ", "is ",
  "are ", "=", ": ", "get " (or the same with a newline), each in turn. `is_matched` needs one of
  these and a digit in what is left, but the grade does not read it.
* format_ok is True whenever the PRM800K grader accepts the answer; otherwise it is whether the
  completion contains both "Step 2:" and "\\box".
* `math_equal`: a "$<number>" or "<number>%" answer loses its sign; "<x>_<base>" keeps the digits
  before "_" as an int (a non-number there makes the score 0); numbers within a relative 1e-4, also
  of the ground truth / 100 or * 100, are equal; tuples, intervals, comma lists, sympy `Point`s
  and `Matrix`es compare element-wise; with "\\pi" on either side both pi = math.pi and pi = 3.14
  are tried (only at the top level: the element-wise comparisons use math.pi).
* verl's final symbolic check (`symbolic_equal`) opens each step with `with timeout_limit(...)`,
  which is a decorator factory and not a context manager, so every step raises a TypeError that
  verl catches: the check is always False. Here it is simply False.
* Any exception in `math_equal` makes the answer wrong (e.g. a "\\begin{pmatrix}" ground truth
  and a "[...]" answer that is not a Python list literal).

Differences from verl, on purpose:

* verl runs Python's `eval` on model output in three places (the "\\pi" substitution, a
  "[...]" matrix answer) and sympy's `parse_expr`, which also evals, on a "Matrix..." answer.
  Here `eval` becomes an evaluator of Python literals and operators only (numbers, strings,
  tuples, lists, sets, dicts, arithmetic, comparisons): an answer that verl would evaluate
  through a name or a call (e.g. "abs(-2)\\pi") is left unevaluated, as verl leaves anything that
  fails to evaluate. `parse_expr` runs only on answers whose names are `Matrix`, sympy functions
  and constants of a short list, or one letter; others count as a failed parse.
* verl runs the PRM800K sympy check in a forked process with a 10 s timeout; see prm800k.py.
  Nothing here uses signals or processes, so a call from any thread scores the same.
"""

from __future__ import annotations

import ast
import io
import math
import re
import tokenize

from grpo_jax.rewards import math_reward, prm800k

_ANSWER_AFTER = ("answer:", "answer is", "answers are")
_ANSWER_BEFORE = ("is answer", "is the answer", "are answers", "are the answers")
_LEAD_INS = ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n")
_DOLLAR_NUMBER_RE = re.compile(r"\$\d+(\.\d+)?")
_PERCENT_RES = (re.compile(r"^\d+(\.\d+)?%$"), re.compile(r"^\d+(\.\d+)?\\%$"))
_INTERVAL_RES = (
    (re.compile(r"^Interval\((.*)\)$"), "[{}]"),
    (re.compile(r"^Interval\.Ropen\((.*)\)$"), "[{})"),
    (re.compile(r"^Interval\.Lopen\((.*)\)$"), "({}]"),
    (re.compile(r"^Interval\.open\((.*)\)$"), "({})"),
)
_PMATRIX = r"\begin{pmatrix}"
_MAX_PREDICTION_CHARS = 1000  # verl: "handling weird corner-cases"


# ---------------------------------------------------------------------------------------------
# Answer extraction.


def _last_boxed_content(text: str) -> str | None:
    """prime_math's _last_boxed_only_string: the stripped content of the last box, or None.

    The box is the last `\\boxed` (or, without one, the last `\\fbox`); its content runs from the
    first "{" after it to the brace that closes it (`math_reward.closing_brace`'s depth rule).
    """
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    end = math_reward.closing_brace(text, start)
    if end is None:
        return None
    return text[text.index("{", start) + 1 : end].strip()


def match_answer(response: str) -> tuple[bool, str]:
    """prime_math's match_answer: (is_matched, the answer text). See the module doc."""
    is_matched = False
    for marker in _ANSWER_AFTER:
        i = response.lower().rfind(marker)
        if i != -1:
            is_matched = True
            response = response[i + len(marker) :].strip()
    for marker in _ANSWER_BEFORE:
        i = response.lower().rfind(marker)
        if i != -1:
            is_matched = True
            response = response[:i].strip()
    boxed = _last_boxed_content(response)
    if boxed:  # an empty box is ignored
        is_matched = True
        response = boxed
    if ". " in response:
        response = response[: response.lower().rfind(". ")].strip()
    for marker in _LEAD_INS:
        i = response.lower().rfind(marker)
        if i != -1:
            is_matched = True
            response = response[i + len(marker) :].strip()
    # verl strips a trailing "\n" (two characters) after each .strip(), which never finds one.
    return is_matched and any(c.isdigit() for c in response), response


# ---------------------------------------------------------------------------------------------
# Evaluation of model output without eval.

_LITERAL_NODES = (
    ast.Expression, ast.Constant, ast.UnaryOp, ast.BinOp, ast.BoolOp, ast.Compare, ast.Tuple,
    ast.List, ast.Set, ast.Dict, ast.Load, ast.unaryop, ast.operator, ast.boolop, ast.cmpop,
)  # fmt: skip


def literal_eval(text: str):
    """Python's `eval(text)` for literals and operators only; raises ValueError on anything else.

    Names, calls, attributes, subscripts, comprehensions and lambdas are refused, so model output
    cannot reach a function. Leading spaces and tabs are dropped, as `eval` drops them.
    """
    tree = ast.parse(text.lstrip(" \t"), mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, _LITERAL_NODES):
            raise ValueError(f"not evaluated: {type(node).__name__} in {text[:80]!r}")
    return eval(compile(tree, "<answer>", "eval"), {"__builtins__": {}})  # noqa: S307 - checked


# sympy names a "Matrix..." answer may use before it is handed to sympy's parse_expr (an eval).
_SYMPY_NAMES = frozenset(
    ("Matrix", "sqrt", "pi", "E", "I", "oo", "exp", "log", "ln", "sin", "cos", "tan", "Rational",
     "Integer", "Float", "frac", "cbrt", "root", "Abs", "abs")  # fmt: skip
)


def _safe_for_parse_expr(text: str) -> bool:
    """Whether `text` has only names of `_SYMPY_NAMES` or one letter, no attribute, no string."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError):
        return False
    for tok in tokens:
        if tok.type == tokenize.NAME and not (len(tok.string) == 1 or tok.string in _SYMPY_NAMES):
            return False
        if tok.type == tokenize.STRING:  # sympify parses (evals) strings inside a Matrix
            return False
        if tok.type == tokenize.OP and tok.string in (".", "...", ":=", "@"):
            return False
    return True


# ---------------------------------------------------------------------------------------------
# ToRA's math_equal (prime_math/grader.py).


def _is_digit(s) -> tuple[bool, float | None]:
    try:
        if "{,}" in str(s):
            return True, float(str(s).replace("{,}", ""))
        return True, float(str(s).replace(",", ""))
    except ValueError:
        return False, None


def _handle_pi(text: str, pi: float):
    """"\\pi" -> "*<pi>" after a digit, "1*<pi>" elsewhere, then evaluated when it is a literal.

    verl's loop resumes its search one character after the replaced "\\pi", inside the inserted
    number, which never holds a "\\pi", so every occurrence is replaced.
    """
    i = text.find("\\pi")
    while i != -1:
        factor = f"*{pi}" if i > 0 and text[i - 1].isdigit() else f"1*{pi}"
        text = text[:i] + factor + text[i + 3 :]
        i = text.find("\\pi", i + 1)
    try:
        return literal_eval(text)
    except Exception:  # noqa: BLE001 - verl keeps the string when eval fails
        return text


def _normalize_value(answer, pi: float):
    """grader.normalize: "$5" -> "5", "5%" -> "5", "<n>_<base>" -> int(n), "\\pi" evaluated."""
    if isinstance(answer, str) and _DOLLAR_NUMBER_RE.match(answer):
        return answer[1:]
    if isinstance(answer, str) and any(p.match(answer) for p in _PERCENT_RES):
        return answer.replace("\\%", "").replace("%", "")
    if isinstance(answer, str) and "_" in answer:
        return int(float(answer.split("_")[0]))  # raises on a non-number: the score is 0
    if isinstance(answer, str) and "\\pi" in answer:
        return _handle_pi(answer, pi)
    return answer


def _format_intervals(prediction: str) -> str:
    """sympy's "Interval(a, b)" (and .Ropen/.Lopen/.open) -> "[a, b]" ("[a, b)", ...)."""
    for pattern, template in _INTERVAL_RES:
        m = pattern.match(prediction)
        if m:
            return template.format(m.group(1))
    return prediction


def _all_equal(pairs, include_percentage: bool, tolerance: float) -> bool:
    """`all([...])` over the element comparisons: every one is evaluated first, as in verl's
    list comprehension, so an exception in any element propagates."""
    return all([math_equal(p, r, include_percentage, tolerance) for p, r in pairs])


def math_equal(
    prediction,
    reference,
    include_percentage: bool = True,
    tolerance: float = 1e-4,
    pi: float = math.pi,
) -> bool:
    """ToRA's math_equal as verl 0.9.1 runs it (see the module doc).

    Args:
      prediction: the extracted answer (a str at the top level; elements may be numbers, lists or
        sympy objects in the element-wise comparisons).
      reference: the ground truth.
      include_percentage: numbers also match the reference / 100 and * 100.
      tolerance: relative tolerance of the numeric comparison.
      pi: the value "\\pi" takes (verl tries math.pi and 3.14 at the top level).

    Raises:
      whatever verl's raises (e.g. ValueError for "x_1"); the scorer counts it as wrong.
    """
    prediction = _normalize_value(prediction, pi)
    reference = _normalize_value(reference, pi)
    if isinstance(prediction, str) and len(prediction) > _MAX_PREDICTION_CHARS:
        prediction = prediction[:_MAX_PREDICTION_CHARS]
    if isinstance(prediction, str) and isinstance(reference, str):
        if prediction.strip().lower() == reference.strip().lower():
            return True
        if prediction.replace(" ", "") == reference.replace(" ", ""):
            return True
    try:
        if _is_digit(prediction)[0] and _is_digit(reference)[0]:
            pred_num, ref_num = _is_digit(prediction)[1], _is_digit(reference)[1]
            candidates = [ref_num]
            if include_percentage:
                candidates = [ref_num / 100, ref_num, ref_num * 100]
            for candidate in candidates:
                try:
                    if math.isclose(candidate, pred_num, rel_tol=tolerance):
                        return True
                except Exception:  # noqa: BLE001, S112 - verl skips a failing candidate
                    continue
            return False
    except Exception:  # noqa: BLE001 - verl falls through to the symbolic checks
        pass
    if not prediction and prediction not in [0, False]:
        return False

    reference = str(reference).strip()
    prediction = _format_intervals(str(prediction).strip())
    pred_str, ref_str = prediction, reference
    square = prediction.startswith("[") and prediction.endswith("]")
    round_ = prediction.startswith("(") and prediction.endswith(")")
    if (square and not reference.startswith("(")) or (round_ and not reference.startswith("[")):
        pred_str, ref_str = pred_str.strip("[]()"), ref_str.strip("[]()")
    for bracket in "{}()":
        ref_str, pred_str = ref_str.replace(bracket, ""), pred_str.replace(bracket, "")
    if pred_str == ref_str:
        return True

    # [a, b] vs [c, d] (same brackets): element-wise.
    if (
        prediction
        and reference
        and prediction[0] in "(["
        and prediction[-1] in ")]"
        and prediction[0] == reference[0]
        and prediction[-1] == reference[-1]
    ):
        pred_parts, ref_parts = prediction[1:-1].split(","), reference[1:-1].split(",")
        if len(pred_parts) == len(ref_parts) and _all_equal(
            zip(pred_parts, ref_parts), include_percentage, tolerance
        ):
            return True
    if "," in prediction and "," in reference:
        pred_parts = [part.strip() for part in prediction.split(",")]
        ref_parts = [part.strip() for part in reference.split(",")]
        if len(pred_parts) == len(ref_parts):  # decides, whatever the later checks would say
            return _all_equal(zip(pred_parts, ref_parts), include_percentage, tolerance)
    # "Point(a, b)" vs "(a, b)"; an empty reference raises IndexError here, as in verl.
    if prediction.startswith("Point") and reference[0] == "(" and reference[-1] == ")":
        pred_parts = prediction[prediction.find("(") + 1 : -1].split(",")
        ref_parts = reference[1:-1].split(",")
        if len(pred_parts) == len(ref_parts) and _all_equal(
            zip(pred_parts, ref_parts), include_percentage, tolerance
        ):
            return True
    if _PMATRIX in reference and prediction.startswith("Matrix"):
        try:
            if not _safe_for_parse_expr(prediction):
                raise ValueError("not parsed: names outside the allowed sympy names")
            from sympy.parsing.sympy_parser import parse_expr

            pred_matrix = parse_expr(prediction)
            ref_items = reference.split()[1:-1:2]
            if len(pred_matrix) == len(ref_items) and _all_equal(
                zip(pred_matrix, ref_items), include_percentage, tolerance
            ):
                return True
        except Exception:  # noqa: BLE001 - verl ignores a failed parse or comparison
            pass
    elif _PMATRIX in reference and prediction.startswith("[") and prediction.endswith("]"):
        if isinstance(literal_eval(prediction), list):  # raises like verl's unguarded eval
            try:
                pred_matrix = literal_eval(prediction)
                body = (
                    reference.removeprefix(r"\\begin{pmatrix}")
                    .removeprefix(r"\begin{pmatrix}")
                    .removesuffix(r"\\end{pmatrix}")
                    .removesuffix(r"\end{pmatrix}")
                )
                rows = [row.split("&") if "&" in row else row for row in body.split("\\")]
                if len(pred_matrix) == len(rows) and _all_equal(
                    zip(pred_matrix, rows), include_percentage, tolerance
                ):
                    return True
            except Exception:  # noqa: BLE001 - verl ignores a failed comparison
                pass
    # verl's symbolic_equal: always False in 0.9.1 (see the module doc).
    return False


# ---------------------------------------------------------------------------------------------
# The scorer.


def prime_math_score(model_output, ground_truth) -> tuple[bool, bool, str]:
    """verl's prime_math.compute_score: (correct, format_ok, extracted answer).

    Args:
      model_output: the decoded completion (str() of anything else, as in verl).
      ground_truth: the reference answer (likewise).

    Returns:
      (correct, format_ok, answer); `default_compute_score` scores float(correct).
    """
    model_output, ground_truth = str(model_output), str(ground_truth)
    _, answer = match_answer(model_output)
    format_ok = "Step 2:" in model_output and "\\box" in model_output
    if prm800k.grade_answer(answer, ground_truth, variant="prime_math"):
        return True, True, answer
    try:
        if "\\pi" in answer or "\\pi" in ground_truth:
            # verl evaluates both before any(), so an error in either makes the answer wrong.
            correct = any([math_equal(answer, ground_truth, pi=pi) for pi in (math.pi, 3.14)])
        else:
            correct = math_equal(answer, ground_truth)
    except Exception:  # noqa: BLE001 - verl scores any failure as wrong
        correct = False
    return correct, format_ok, answer
