"""grpo_jax.reward_score against verl 0.9.1's rule-based scorers.

Two kinds of test:

* Hand-derived cases, each with the verl quirk it pins down in a comment.
* Parity with verl itself on thousands of generated (completion, ground truth) pairs: LaTeX
  answers built from a small grammar (fractions, roots, units, degrees, percents, dollars,
  intervals, equations, decimals, ...), perturbed (spaces, `\\!`, `\\left`, trailing periods,
  dropped or doubled characters, ...) and wrapped in completions (boxes of every kind, several
  boxes, none, "Answer:" lines, long prefixes that cross verl's 300 / 100 character windows). Each
  pair is scored here and by verl in the reference worker (tests/reference.py; one round trip per
  scorer, the calls sent as one tuple), and every result must be equal, types included. The
  generator is seeded, so a failure reproduces; the cases are not hand-picked.
"""

import random
import re
import sys

import pytest
import reference

from grpo_jax.rewards import scorers

RS = "verl.utils.reward_score."

# ---------------------------------------------------------------------------------------------
# Hand-derived cases.


@pytest.mark.parametrize(
    "solution, ground_truth, expected",
    [
        ("The answer is \\boxed{\\dfrac{1}{2}}.", "\\frac{1}{2}", 1.0),  # dfrac -> frac
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),  # a whole "0.5" becomes \frac{1}{2}
        # ".5" gets its 0 (then -> \frac{1}{2}); "\frac12" is braced by fix_fracs.
        ("\\boxed{.5}", "\\frac12", 1.0),
        ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),  # int a/b -> \frac{a}{b}
        ("\\boxed{01/2}", "\\frac{1}{2}", 0.0),  # "01" prints back as "1": not rewritten
        ("\\boxed{10\\text{ cm}}", "10", 1.0),  # a "\text{ unit}" and what follows is dropped
        # two "\text{ " units: normalisation fails and the raw strings differ.
        ("\\boxed{1\\text{ cm}\\text{ cm}}", "1", 0.0),
        ("\\boxed{1\\frac}", "1\\frac", 1.0),  # a bare "\frac" fails both sides: raw-equal
        ("\\boxed{1 \\frac}", "1\\frac", 0.0),  # ... and then a space matters
        ("\\boxed{30^\\circ}", "30", 1.0),
        ("\\boxed{50\\%}", "50", 1.0),
        ("\\boxed{\\$5}", "5", 1.0),
        ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),  # \left, \right and spaces go
        ("\\boxed{x = 5}", "5", 1.0),  # a left-hand side of <= 2 characters is dropped
        ("\\boxed{abc = 5}", "5", 0.0),  # ... a longer one is kept
        ("\\boxed{\\sqrt2}", "\\sqrt{2}", 1.0),  # fix_sqrt braces the next character
        # ... even a space: "\sqrt 2" -> "\sqrt{ }2" -> "\sqrt{}2" once spaces go.
        ("\\boxed{\\sqrt 2}", "\\sqrt{2}", 0.0),
        ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt2}", 1.0),  # nested braces
        ("\\fbox{5}", "5", 0.0),  # found, but remove_boxed rejects an fbox
        # "\boxed" without "{" or " ": the group "\boxed\frac{1}" is rejected by remove_boxed.
        ("\\boxed\\frac{1}{2}", "\\frac{1}{2}", 0.0),
        # "\boxed " (space) anywhere wins over a later "\boxed{...}"; it stops at "$".
        ("$\\boxed 5$ and then \\boxed{6}", "5", 1.0),
        ("\\boxed{5} then \\boxed{6}", "6", 1.0),  # the last box counts
        ("\\boxed{5} then \\boxed{6}", "5", 0.0),
        ("the answer is 5", "5", 0.0),  # no box
        ("\\boxed{5", "5", 0.0),  # never closed
    ],
)
def test_math_score_hand_cases(solution, ground_truth, expected):
    assert scorers.math_score(solution, ground_truth) == expected


def test_math_helpers():
    assert scorers.last_boxed_only_string("a \\boxed{x{y}} b") == "\\boxed{x{y}}"
    # A "}" before any "{" drives the depth below 0; it never comes back to exactly 0.
    assert scorers.last_boxed_only_string("\\boxed}{}") is None
    assert scorers.remove_boxed("\\boxed 7") == "7"
    with pytest.raises(ValueError, match="fbox"):
        scorers.remove_boxed("\\fbox{7}")
    assert scorers.strip_math_string("k = \\tfrac{3}{4}\\!") == "\\frac{3}{4}"
    # A one-character "\frac3" makes fix_fracs return its input, undoing the "\frac12" fix too.
    assert scorers.strip_math_string("\\frac12+\\frac3") == "\\frac12+\\frac3"
    assert scorers.strip_math_string("\\frac12+\\frac34") == "\\frac{1}{2}+\\frac{3}{4}"
    assert scorers.math_is_equiv(None, None) and not scorers.math_is_equiv("1", None)


def _dapo(score, pred):
    return {"score": score, "acc": score == 1.0, "pred": pred}


_BOX_100 = "\\boxed{5}" + "y" * 91  # 100 characters, the box in the first 9


def _pause(last):
    return {"pause_tokens_index": [0, 0, 0, last]}


@pytest.mark.parametrize(
    "solution, ground_truth, kwargs, expected",
    [
        ("Answer: 5", "5", {}, _dapo(1.0, "5")),
        # "\s*" after the colon crosses the newline; "$...$" is unwrapped, commas of an int go.
        ("answer :\n$1,000$", "1000", {}, _dapo(1.0, "1000")),
        ("Answer: 10 cm", "10", {}, _dapo(1.0, "10")),  # spaces, then the unit "cm", go
        # the text after the last "=" counts; "\frac12" -> "\frac{1}{2}".
        ("Answer: x = \\frac12", "\\frac{1}{2}", {}, _dapo(1.0, "\\frac{1}{2}")),
        # no "Answer:": the box is compared raw, so "\frac{1}{2}" != "\frac12".
        ("\\boxed{\\frac{1}{2}}", "\\frac12", {}, _dapo(-1.0, "\\frac{1}{2}")),
        ("The result is 5.", "5", {}, _dapo(-1.0, "[INVALID]")),
        ("Answer: 4\n\\boxed{5}", "5", {}, _dapo(-1.0, "4")),  # "Answer:" wins over the box
        ("Answer: [INVALID]\n\\boxed{5}", "5", {}, _dapo(1.0, "5")),  # ... unless it reads so
        ("Answer: 5", "5", {"strict_box_verify": True}, _dapo(-1.0, None)),  # box only
        ("\\boxed{5}" + "x" * 92, "5", {}, _dapo(-1.0, "[INVALID]")),  # box out of last 100
        ("Answer: 5" + "x" * 300, "5", {}, _dapo(-1.0, "[INVALID]")),  # out of last 300
        # the window ends at pause_tokens_index[-1]: text[100 - 100:] holds the box ...
        (_BOX_100, "5", _pause(100), _dapo(1.0, "5")),
        # ... text[120 - 100:] does not, and text[10 - 100:] is a negative slice start.
        (_BOX_100, "5", _pause(120), _dapo(-1.0, "[INVALID]")),
        (_BOX_100, "5", _pause(10), _dapo(-1.0, "[INVALID]")),
    ],
)
def test_math_dapo_hand_cases(solution, ground_truth, kwargs, expected):
    got = scorers.math_dapo_score(solution, ground_truth, **kwargs)
    assert got == expected and type(got["acc"]) is bool


def test_math_dapo_pause_tokens_checked_only_on_the_box_path():
    assert scorers.math_dapo_score("Answer: 5", "5", pause_tokens_index=[1])["acc"]
    with pytest.raises(ValueError, match="4 indices"):
        scorers.math_dapo_score("\\boxed{5}", "5", pause_tokens_index=[1])


def test_normalize_final_answer():
    # the article "an " goes, then \text{...} is unwrapped.
    assert scorers.normalize_final_answer("\\text{an apple}") == "apple"
    # "a " goes inside a word too: "banana 5" -> "banan5".
    assert scorers.normalize_final_answer("banana 5") == "banan5"
    assert scorers.normalize_final_answer("\\boxed{\\sqrt3}") == "\\sqrt{3}"
    assert scorers.normalize_final_answer("12^\\circ") == "12"


def test_default_compute_score_dispatch_and_types():
    assert scorers.default_compute_score("openai/gsm8k", "#### 5", "5") == 1.0
    got = scorers.default_compute_score("HuggingFaceH4/MATH-500", "\\boxed{5}", "5")
    assert got == 1.0 and type(got) is float
    assert scorers.default_compute_score("aime2024", "Answer: 5", "5") == _dapo(1.0, "5")
    assert scorers.default_compute_score("math", "Answer: 4", "5") == _dapo(-1.0, "4")


# verl's sources that grpo_jax does not port name verl's module; whichever those are.
def test_unknown_data_source_message():
    # Every source verl 0.9.1's default_compute_score routes is scored here; any other gets a
    # message naming it, the supported ones and how to plug in a custom reward.
    with pytest.raises(NotImplementedError) as e:
        scorers.default_compute_score("my/dataset", "\\boxed{5}", "5")
    msg = str(e.value)
    assert "'my/dataset'" in msg and "'openai/gsm8k'" in msg and "'aime'" in msg
    assert "'codecontests'" in msg and "'hiyouga/geometry3k'" in msg and "'searchR1_nq'" in msg
    assert "custom_reward_function.path" in msg and "reward.fn=module:function" in msg


def test_math_verify_missing_names_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    with pytest.raises(ImportError, match="pip install math-verify"):
        scorers.math_verify_score("\\boxed{1}", "1")


def test_math_verify_hand_cases():
    pytest.importorskip("math_verify")
    assert scorers.math_verify_score("so $\\boxed{\\frac{1}{2}}$", "0.5") == 1.0
    assert scorers.math_verify_score("The answer is $3$.", "4") == 0.0
    assert scorers.math_verify_score("no math here", "4") == 0.0


# ---------------------------------------------------------------------------------------------
# Generated cases.


def _int(r: random.Random) -> str:
    n = r.choice([r.randint(0, 12), r.randint(-20, 100), r.randint(1000, 99999)])
    s = str(n)
    if abs(n) >= 1000 and r.random() < 0.4:
        s = f"{n:,}"
    return s


def _decimal(r):
    return r.choice(["0.5", ".5", "-0.5", "3.14", "2.0", "0.25", ".75", "1.5", "10.", "0.0"])


def _frac(r):
    a, b = r.randint(1, 12), r.randint(2, 12)
    style = r.randrange(10)
    cmd = r.choice(["\\frac", "\\dfrac", "\\tfrac"])
    if style == 0:
        return f"{a}/{b}"
    if style == 1:
        return f"{cmd}{a % 10}{b % 10}"  # shorthand \frac12
    if style == 2:
        return f"{cmd}{a % 10}{{{b}}}"  # \frac1{72}
    if style == 3:
        return f"{cmd} {a % 10} {b % 10}"
    if style == 4:
        return f"-{cmd}{{{a}}}{{{b}}}"
    if style == 5:
        return f"{cmd}{{\\sqrt{{{a}}}}}{{{b}}}"
    if style == 6:
        return f"0{a}/{b}"
    return f"{cmd}{{{a}}}{{{b}}}"


def _sqrt(r):
    n = r.randint(2, 30)
    return r.choice(
        [
            f"\\sqrt{{{n}}}",
            f"\\sqrt {n}",
            f"\\sqrt{n}",
            f"{r.randint(2, 9)}\\sqrt{{{n}}}",
            f"{r.randint(2, 9)}\\sqrt{n % 10}",
            f"\\sqrt{{\\frac{{1}}{{{n}}}}}",
            f"\\frac{{\\sqrt {n % 10}}}{{2}}",
        ]
    )


def _unit(r):
    unit = r.choice(
        [
            "\\text{ cm}",
            "\\text{ inches}",
            " \\text{cm}",
            "\\mbox{ cm}",
            " cm",
            " degrees",
            "\\text{ m}^2",
            "\\text{m}",
            " units",
            "\\text{ cm}\\text{ cm}",
            " square feet",
            "\\text{s}",
        ]
    )
    return _int(r) + unit


def _degree_percent_dollar(r):
    n = _int(r)
    return r.choice(
        [
            f"{n}^\\circ",
            f"{n}^{{\\circ}}",
            f"{n}^\\circ C",
            f"{n}\\%",
            f"{n}%",
            f"{n}\\\\%",
            f"\\${n}",
            f"${n}$",
            f"{n} dollars",
            f"\\${n}.00",
        ]
    )


def _interval(r):
    def end(r):
        return r.choice([_int(r), _frac(r), "\\infty", "-\\infty", _decimal(r)])

    left, right = r.choice("(["), r.choice(")]")
    sep = r.choice([",", ", ", " , "])
    body = f"{end(r)}{sep}{end(r)}"
    if r.random() < 0.4:
        return f"\\left{left} {body} \\right{right}"
    if r.random() < 0.2:
        return f"\\{{{body}\\}}"
    return f"{left}{body}{right}"


def _expression(r):
    return r.choice(
        [
            "\\text{(A)}",
            "\\textbf{B}",
            "(C)",
            "\\text{Monday}",
            "\\overline{3}",
            "\\pi",
            "2\\pi",
            "\\infty",
            "x^2 + 1",
            "3x-2",
            "1 \\pm \\sqrt{2}",
            "\\frac{\\pi}{4}",
            "a",
            "an apple",
            "\\mathrm{th}",
            "10^{10}",
            "\\{1,2\\}",
            "\\text{and}",
            "1, 2, \\text{and} 3",
            "2^{\\frac{1}{3}}",
            "\\dots",
            '"yes"',
            "[INVALID]",
            "\\frac12+\\frac3",  # a fixed shorthand, then one that leaves the string as is
            "\\frac{1}{2}\\frac",
            "",
        ]
    )


def _equation(r):
    var = r.choice(["x", "k", "y", "ab", "abc", "f(x)", "x_1"])
    return f"{var}{r.choice(['=', ' = ', '= '])}{_atom(r, equation=False)}"


def _atom(r, *, equation=True):
    makers = [_int, _decimal, _frac, _sqrt, _unit, _degree_percent_dollar, _interval, _expression]
    if equation:
        makers.append(_equation)
    return r.choice(makers)(r)


def _perturb(r, s):
    """A variant of `s` that verl's normalisers may or may not map to the same string."""
    for _ in range(r.randint(0, 3)):
        op = r.randrange(19)
        i = r.randint(0, len(s))
        if op == 0:
            s = s[:i] + " " + s[i:]
        elif op == 1:
            s = s[:i] + r.choice(["\\!", "\\,", "\\;", "\\ ", "{,}"]) + s[i:]
        elif op == 2:
            s += r.choice([".", "\\text{.}", "\\,.", " ."])
        elif op == 3:
            s = f"${s}$"
        elif op == 4:
            s = s.replace("\\frac", r.choice(["\\dfrac", "\\tfrac", "\\frac"]))
        elif op == 5:
            s = s.replace("(", "\\left(").replace(")", "\\right)")
        elif op == 6:
            s = r.choice(["x = ", "k=", "n =", "abc = "]) + s
        elif op == 7:
            s = s.replace("0.", ".") if "0." in s else s.replace(".", "0.", 1)
        elif op == 8:
            s = s[:i] + "\n" + s[i:]
        elif op == 9:
            s = s.replace("\\", "\\\\", 1)
        elif op == 10 and s:
            s = s[: i - 1] + s[i:] if i else s[1:]  # drop a character (braces break)
        elif op == 11 and s:
            j = min(i, len(s) - 1)
            s = s[:j] + s[j] + s[j:]  # double a character
        elif op == 12:
            s = s.replace("/", "\\frac", 1) if "/" in s else s + "/2"
        elif op == 13:
            s += r.choice(["\\text{ cm}", " cm", "\\mbox{ inches}", " units"])
        elif op == 14:
            s += r.choice(["^\\circ", "^{\\circ}", "\\%", "%"])
        elif op == 15:
            s += r.choice(["\\frac", "\\sqrt", "\\frac1", "\\sqrt\\sqrt"])
        elif op == 16:
            s = s.replace(",", "", 1) if "," in s else s
        elif op == 17:  # shorthand <-> braced one-digit \frac and \sqrt arguments
            short = re.sub(r"\\(frac|sqrt)\{(\d)\}(?:\{(\d)\})?", r"\\\1\2\3", s)
            s = short if short != s else re.sub(r"\\(frac|sqrt)(\d)", r"\\\1{\2}", s)
        else:
            s = r.choice(["\\$", "$", "\\boxed{", ""]) + s + r.choice(["", "}", "$"])
    return s


def _answer_pair(r):
    """(prediction, ground truth): mostly a perturbed copy, sometimes unrelated answers."""
    gt = _atom(r)
    if r.random() < 0.7:
        pred = _perturb(r, gt) if r.random() < 0.75 else gt
    else:
        pred = _atom(r)
    if r.random() < 0.3:
        gt = _perturb(r, gt)
    return pred, gt


# Prefix words: numbers, "$", braces and an "answer:" that later text must override.
_WORDS = ("so", "we", "get", "3", "+", "4", "=", "7", "then", "$x$", "is", "{", "the", "}")
_WORDS += ("value", "and", "12", "answer:", "box")


def _prefix(r):
    n = r.choice([0, 0, 3, 10, 40, 80])
    text = " ".join(r.choice(_WORDS) for _ in range(n))
    return text + r.choice(["", " ", "\n", ". ", "\n\n"])


def _boxed_completion(r, a):
    decoy = _atom(r)
    templates = [
        lambda: f"The answer is $\\boxed{{{a}}}$.",
        lambda: f"\\boxed{{{a}}}",
        lambda: f"so $\\boxed {a}$ done",
        lambda: f"\\boxed {a}",
        lambda: f"\\boxed{{{decoy}}} no wait, \\boxed{{{a}}}",
        lambda: f"\\boxed{{{a}}} or maybe \\boxed{{{decoy}}}",
        lambda: f"\\boxed {decoy}$ and \\boxed{{{a}}}",
        lambda: f"\\fbox{{{a}}}",
        lambda: f"\\boxed{a}",
        lambda: f"The answer is {a}.",
        lambda: f"\\boxed{{{a}",
        lambda: f"\\boxed{{ {a} }}",
        lambda: f"\\boxed{{\\{{{a}\\}}}}",
        lambda: f"\\boxed{{{a}}}" + " and so on" * r.randint(1, 12),
        lambda: f"Answer: {a}",
        lambda: f"#### {a}",
    ]
    return _prefix(r) + r.choice(templates)()


def _dapo_completion(r, a):
    decoy = _atom(r)
    templates = [
        lambda: f"Answer: {a}",
        lambda: f"Answer: ${a}$",
        lambda: f"answer:{a}",
        lambda: f"ANSWER :  {a}\n",
        lambda: f"Final Answer: The final answer is ${a}$. I hope it is correct.",
        lambda: f"Answer:\n{a}",
        lambda: f"Answer: {decoy}\nAnswer: {a}",
        lambda: f"Answer: {a}\nAnswer: {decoy}",
        lambda: f"\\boxed{{{a}}}",
        lambda: f"Answer: {decoy} so \\boxed{{{a}}}",
        lambda: f"the result is {a}",
        lambda: f"Answer: [INVALID]\n\\boxed{{{a}}}",
        lambda: f"\\boxed{{{a}}}" + " filler" * r.randint(5, 20),
        lambda: f"\\boxed{{{decoy}}} then \\boxed{{{a}}}",
        lambda: f"\\boxed {a}",
        lambda: f"Answer: \\boxed{{{a}}}",
    ]
    return _prefix(r) + r.choice(templates)()


def _math_cases(seed, n):
    r = random.Random(seed)
    cases = []
    for _ in range(n):
        pred, gt = _answer_pair(r)
        cases.append((_boxed_completion(r, pred), gt))
    return cases


def _dapo_cases(seed, n):
    """(solution, ground truth, kwargs) with every keyword combination of math_dapo."""
    r = random.Random(seed)
    cases = []
    for _ in range(n):
        pred, gt = _answer_pair(r)
        kwargs = {}
        if r.random() < 0.25:
            kwargs["strict_box_verify"] = r.random() < 0.5
        if r.random() < 0.2:
            kwargs["pause_tokens_index"] = [0, 1, 2, r.randint(0, 320)]
        cases.append((_dapo_completion(r, pred), gt, kwargs))
    return cases


def _gsm8k_cases(seed, n):
    r = random.Random(seed)
    cases = []
    for _ in range(n):
        gt = str(r.choice([r.randint(0, 50), r.randint(100, 9999), r.randint(-9, -1)]))
        answer = r.choice([gt, f"{int(gt):,}", gt + ".0", f"${gt}", str(int(gt) + 1), "."])
        tail = r.choice(
            [
                f"#### {answer}",
                f"####{answer}",
                f"#### {answer}\n#### {r.randint(0, 9)}",
                f"The answer is {answer}.",
                f"{answer} apples, . and ..",
                "no numbers",
                f"#### {answer}" + " pad" * r.randint(0, 80),
            ]
        )
        method = r.choice(["strict", "flexible"])
        cases.append((_prefix(r) + tail, gt, method))
    return cases


def _verl_values(verl, calls):
    return verl.run(tuple(calls)).value


def _assert_all_equal(name, cases, ours, theirs):
    # repr compares types too: 1.0 vs 1, True vs 1.0, None vs "".
    bad = [(c, o, t) for c, o, t in zip(cases, ours, theirs, strict=True) if repr(o) != repr(t)]
    shown = "\n".join(f"  {c!r}: ours {o!r}, verl {t!r}" for c, o, t in bad[:10])
    assert not bad, f"{name}: {len(bad)} of {len(cases)} cases differ from verl:\n{shown}"


N_MATH, N_DAPO, N_GSM8K, N_DISPATCH, N_MATH_VERIFY = 6000, 6000, 2000, 3000, 300


def test_math_reward_parity_generated(verl):
    cases = _math_cases(0, N_MATH)
    fn = reference.fn(RS + "math_reward:compute_score")
    theirs = _verl_values(verl, (fn(s, g) for s, g in cases))
    ours = [scorers.math_score(s, g) for s, g in cases]
    _assert_all_equal("math_reward", cases, ours, theirs)
    # The set exercises both outcomes, not just misses.
    assert 0.1 * len(cases) < sum(ours) < 0.9 * len(cases)


def test_math_reward_helpers_parity_generated(verl):
    """The public helpers: last_boxed_only_string and is_equiv (strip_string) on their own."""
    cases = _math_cases(1, N_MATH)
    mod = RS + "math_reward:"
    theirs = _verl_values(verl, (reference.fn(mod + "last_boxed_only_string")(s) for s, _ in cases))
    ours = [scorers.last_boxed_only_string(s) for s, _ in cases]
    _assert_all_equal("last_boxed_only_string", cases, ours, theirs)
    r = random.Random(2)
    pairs = [_answer_pair(r) for _ in range(N_MATH)]
    theirs = _verl_values(verl, (reference.fn(mod + "is_equiv")(a, b) for a, b in pairs))
    ours = [scorers.math_is_equiv(a, b) for a, b in pairs]
    _assert_all_equal("is_equiv", pairs, ours, theirs)
    assert 0.1 * len(pairs) < sum(ours) < 0.9 * len(pairs)


def test_math_dapo_parity_generated(verl):
    cases = _dapo_cases(3, N_DAPO)
    fn = reference.fn(RS + "math_dapo:compute_score")
    theirs = _verl_values(verl, (fn(s, g, **kw) for s, g, kw in cases))
    ours = [scorers.math_dapo_score(s, g, **kw) for s, g, kw in cases]
    _assert_all_equal("math_dapo", cases, ours, theirs)
    hits = sum(o["acc"] for o in ours)
    assert 0.1 * len(cases) < hits < 0.9 * len(cases)
    r = random.Random(4)
    answers = [_perturb(r, _atom(r)) for _ in range(N_DAPO)]
    norm = reference.fn(RS + "math_dapo:normalize_final_answer")
    theirs = _verl_values(verl, (norm(a) for a in answers))
    ours = [scorers.normalize_final_answer(a) for a in answers]
    _assert_all_equal("normalize_final_answer", answers, ours, theirs)


def test_gsm8k_parity_generated(verl):
    cases = _gsm8k_cases(5, N_GSM8K)
    fn = reference.fn(RS + "gsm8k:compute_score")
    theirs = _verl_values(verl, (fn(s, g, method=m, format_score=0.1) for s, g, m in cases))
    ours = [scorers.gsm8k_score(s, g, method=m, format_score=0.1) for s, g, m in cases]
    # verl returns int 0 when no answer is found; ours is 0.0 (default_compute_score makes
    # verl's a float too, which the dispatch test checks with types).
    _assert_all_equal("gsm8k", cases, ours, [float(t) for t in theirs])


SOURCES = (
    scorers.GSM8K_SOURCES
    + scorers.MATH_SOURCES
    + scorers.DAPO_SOURCES
    + ("aime2024", "aime25", "aime")
)


def test_default_compute_score_parity_generated(verl):
    r = random.Random(6)
    cases = []
    for i in range(N_DISPATCH):
        source = SOURCES[i % len(SOURCES)]
        pred, gt = _answer_pair(r)
        completion = r.choice([_boxed_completion, _dapo_completion])(r, pred)
        if source == "openai/gsm8k" and r.random() < 0.5:
            completion = f"{completion}\n#### {gt}"
        cases.append((source, completion, gt))
    fn = reference.fn(RS[:-1] + ":default_compute_score")
    theirs = _verl_values(verl, (fn(d, s, g, extra_info={"index": 0}) for d, s, g in cases))
    ours = [
        scorers.default_compute_score(d, s, g, extra_info={"index": 0}) for d, s, g in cases
    ]
    _assert_all_equal("default_compute_score", cases, ours, theirs)
    assert {type(o) for o in ours} == {float, dict}


def test_unknown_data_source_raises_like_verl(verl):
    with pytest.raises(reference.WorkerError, match="NotImplementedError"):
        verl.run(reference.fn(RS[:-1] + ":default_compute_score")("my/dataset", "\\boxed{5}", "5"))
    with pytest.raises(NotImplementedError, match="my/dataset"):
        scorers.default_compute_score("my/dataset", "\\boxed{5}", "5")


def test_math_verify_parity_generated(verl):
    pytest.importorskip("math_verify", reason="pip install math-verify (requirements.txt)")
    # latex2sympy2 has one parser build per antlr4 runtime, and they disagree on some LaTeX, so
    # the comparison is only meaningful with verl's runtime (hydra-core pins 4.9.3 there).
    import importlib.metadata

    antlr = "antlr4-python3-runtime"
    theirs = verl.run(reference.fn("importlib.metadata:version")(antlr)).value
    ours = importlib.metadata.version(antlr)
    assert ours == theirs, (
        f"{antlr} {ours} here but {theirs} in verl's venv: "
        "pip install 'antlr4-python3-runtime==4.9.3' (requirements.txt)"
    )
    cases = _math_cases(7, N_MATH_VERIFY)
    fn = reference.fn(RS + "math_verify:compute_score")
    theirs = _verl_values(verl, (fn(s, g) for s, g in cases))
    ours = [scorers.math_verify_score(s, g) for s, g in cases]
    _assert_all_equal("math_verify", cases, ours, theirs)
    assert 0.1 * len(cases) < sum(ours) < 0.9 * len(cases)
