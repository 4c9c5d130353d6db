"""PRIME math, Geometry3K and Search-R1 scorers against verl 0.9.1, and scorers off the main thread.

As in test_reward_score.py: hand-derived cases, each pinning a verl quirk in a comment, and parity
with verl itself on generated (completion, ground truth) pairs, scored here and by verl in the
reference worker (tests/reference.py), every result equal, types included. The generators reuse
test_reward_score's LaTeX answer grammar and add the forms these scorers treat specially (units,
"$5", "5%", bases, "\\pi", tuples, intervals, Point, Matrix, pmatrix, words, "answer is ...").
"""

import math
import random
import signal
import threading

import numpy as np
import pytest
import reference
import test_reward_score as base

from grpo_jax.rewards import geo3k, prime_math, prm800k, qa_em, scorers

RS = base.RS

# ---------------------------------------------------------------------------------------------
# Hand-derived cases.


@pytest.mark.parametrize(
    "solution, ground_truth, expected",
    [
        # the grader's mathd step: "\dfrac12" and "0.5" both normalise to "\frac{1}{2}".
        ("The answer is \\boxed{\\dfrac12}", "0.5", (True, True, "\\dfrac12")),
        # sympy: 2x+2 - 2(x+1) simplifies to 0 (implicit multiplication).
        ("answer: 2x+2", "2(x+1)", (True, True, "2x+2")),
        # math_equal with pi = 3.14: "3.14" == "\pi"; format_ok needs "Step 2:" and "\box".
        ("so it is 3.14", "\\pi", (True, False, "3.14")),
        # an unreduced fraction is not equal to the reduced one (string compare), and math_equal's
        # numbers only cover floats: "2/4" is no float.
        ("\\boxed{2/4}", "1/2", (False, False, "2/4")),
        # numbers within a relative 1e-4, or 100x the reference: "50" matches "0.5".
        ("Step 2: \\boxed{50}", "0.5", (True, True, "50")),
        ("\\boxed{0.33333}", "1/3", (False, False, "0.33333")),  # "1/3" is no float either
        # the last "be "/"is "/"=" wins: "x = 3" -> "3".
        ("we find that x = 3", "3", (True, True, "3")),
        # ". " cuts the sentence after the answer, "is " then takes "7".
        ("The result is 7. Done", "7", (True, True, "7")),
        # "<n>_<base>": the digits before "_" as an int; a non-number there is an error: wrong.
        # (the grader fails, so format_ok is the "Step 2:" check: False).
        ("answer: 101_2", "101", (True, False, "101_2")),
        ("answer: x_1", "5", (False, False, "x_1")),
        # symbolic_equal is always False in verl 0.9.1 (a decorator used as a context manager).
        ("answer: \\sin^2 x + \\cos^2 x", "1", (False, False, "\\sin^2 x + \\cos^2 x")),
        # the comma-list check comes before the Point one and decides: "Point(1" != "(1".
        ("answer: Point(1, 2)", "(1,2)", (False, False, "Point(1, 2)")),
        # sympy Interval -> brackets.
        ("answer: Interval(0, 1)", "[0,1]", (True, False, "Interval(0, 1)")),
    ],
)
def test_prime_math_hand_cases(solution, ground_truth, expected):
    assert prime_math.prime_math_score(solution, ground_truth) == expected


def test_prime_math_match_answer():
    # "answer:" then the box, then ". ", then "is ".
    assert prime_math.match_answer("The answer: see \\boxed{ 12 }") == (True, "12")
    # no digit left: not matched (the grade does not read it).
    assert prime_math.match_answer("the answer is blue") == (False, "blue")
    # an empty box is skipped; "\fbox" counts only without any "\boxed".
    assert prime_math.match_answer("\\fbox{5}") == (True, "5")
    assert prime_math.match_answer("\\boxed{} \\fbox{5}") == (False, "\\boxed{} \\fbox{5}")


def test_prime_math_never_evals_model_output(tmp_path):
    marker = tmp_path / "ran"
    attack = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    # verl would eval these (the "\pi" substitution; a "[...]" answer to a pmatrix question).
    prime_math.prime_math_score(f"answer: {attack} or \\pi", "\\pi")
    prime_math.prime_math_score(f"answer: [{attack}]", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}")
    prime_math.prime_math_score(
        f"answer: Matrix([{attack}])", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"
    )
    assert not marker.exists()
    assert prime_math.literal_eval(" (1*3.14, 2^3)") == (3.14, 1)
    with pytest.raises(ValueError, match="not evaluated"):
        prime_math.literal_eval("abs(-2)")


def test_prm800k_variants_differ_where_verl_copies_do():
    # mathruler removes a bare "%", prime_math's mathd step keeps it (then PRM800K's drops it).
    assert prm800k.mathd_normalize("50%", variant="mathruler") == "50"
    assert prm800k.mathd_normalize("50%", variant="prime_math") == "50%"
    # mathruler drops braces and spaces after the mixed-number step; prime_math keeps them.
    assert prm800k.normalize("x^{2}", variant="mathruler") == "x^2"
    assert prm800k.normalize("\\{1,2\\}", variant="prime_math") == "{1,2}"
    # "liter" is a unit only for prime_math; units go anywhere, also inside words.
    assert prm800k.normalize("5 liters", variant="prime_math") == "5"
    assert prm800k.normalize("5 liters", variant="mathruler") == "5liters"
    assert prm800k.normalize("Monday", variant="mathruler") == "mon"  # "day" is a unit
    # two-digit exponents are not handed to sympy.
    assert not prm800k.are_equal_under_sympy("x^10", "x^10")
    assert prm800k.grade_answer("(1, 2)", "[1,2]", variant="prime_math") is False  # brackets


@pytest.mark.parametrize(
    "solution, ground_truth, expected",
    [
        ("<think>r</think> so \\boxed{5}", "5", 1.0),  # (1 - 0.1) * 1 + 0.1 * 1
        ("<think>r</think> so 5", "5", 0.0),
        ("so \\boxed{5}", "5", 0.9),  # no <think>: no format point
        ("<think>r</think> so \\boxed{4}", "5", 0.1),  # format only
        ("<think>\\boxed{5}</think> 5", "5", 0.9),  # the box must follow </think> for format
        ("no box", "None", 0.9),  # no box -> the string "None", graded like any answer
        ("\\boxed{30^\\circ}", "30", 0.9),
        ("\\boxed 5", "5", 0.0),  # "\boxed " is no box here
        (" <think>r</think>\\boxed{5}", "5", 0.9),  # "<think>" must open the completion
    ],
)
def test_geo3k_hand_cases(solution, ground_truth, expected):
    assert geo3k.geo3k_score(solution, ground_truth) == expected


@pytest.mark.parametrize(
    "solution, target, expected",
    [
        ("<answer>The Eiffel Tower</answer>", "eiffel tower", 1.0),  # article, case
        ("<answer>Paris.</answer>", ["London", "paris"], 1.0),  # punctuation, a list of golds
        ("<answer>a</answer> <answer>Paris</answer>", "paris", 1.0),  # the last span
        ("<answer>Paris, France</answer>", "paris", 0.0),  # exact match, not containment
        ("no tags: paris", "paris", 0),  # int 0 without an answer span
        ("<answer>paris</answer>" * 11, "paris", 0.25),  # > 10 tags: score / 4
        ("<answer>london</answer>" * 11, "paris", 0.0),  # ... only when correct
        ("<answer>the-end</answer>", "end", 0.0),  # punctuation goes first: "theend"
        ("<answer>\nparis\n</answer>", np.array(["Paris"]), 1.0),  # spans newlines; arrays
    ],
)
def test_qa_em_hand_cases(solution, target, expected):
    got = qa_em.qa_em_score(solution, {"target": target})
    assert got == expected and type(got) is type(expected)


def test_qa_subem():
    assert qa_em.qa_subem_score("<answer>Paris, France</answer>", {"target": "paris"}) == 1.0
    assert qa_em.qa_subem_score("<answer>Paris</answer>" * 11, {"target": "paris"}) == 1.0


def test_dispatch_new_sources():
    score = scorers.default_compute_score
    assert score("numina_olympiads", "\\boxed{5}", "5") == 1.0
    assert score("hiyouga/geometry3k", "\\boxed{5}", "5") == 0.9
    got = score("searchR1_nq", "<answer>x</answer>", {"target": ["y"]})
    assert got == 0.0 and type(got) is float


# ---------------------------------------------------------------------------------------------
# Off the main thread, and no signals.

_THREAD_CASES = [
    ("numina_cn_k12", "answer: 2x+2", "2(x+1)"),
    ("numina_amc_aime", "so it is 3.14", "\\pi"),
    ("hiyouga/geometry3k", "<think>r</think>\\boxed{\\frac{\\sqrt{3}}{2}}", "\\sqrt{3}/2"),
    ("searchR1_hotpotqa", "<answer>Paris</answer>", {"target": ["paris"]}),
    ("lighteval/MATH", "\\boxed{\\frac12}", "0.5"),
]


def _in_thread(fn, *args):
    out = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    t.join(timeout=120)
    assert out, "the scorer did not return in its thread"
    return out[0]


def test_scorers_score_the_same_off_the_main_thread():
    for case in _THREAD_CASES:
        main = scorers.default_compute_score(*case)
        assert _in_thread(scorers.default_compute_score, *case) == main and main > 0, case


def test_math_verify_scores_in_a_worker_thread():
    pytest.importorskip("math_verify", reason="pip install math-verify (requirements.txt)")
    # math-verify's own timeouts use signal.alarm, which raises off the main thread and makes
    # verl score 0; math_verify_score disables them.
    cases = [("so $x = \\frac{1}{2}$", "0.5"), ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}")]
    for solution, gt in cases:
        assert _in_thread(scorers.math_verify_score, solution, gt) == 1.0


def test_no_scorer_uses_signals(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a scorer used a signal-based timeout")

    for name in ("alarm", "setitimer", "signal"):
        monkeypatch.setattr(signal, name, refuse)
    for case in _THREAD_CASES:
        assert scorers.default_compute_score(*case) > 0, case
    pytest.importorskip("math_verify", reason="pip install math-verify (requirements.txt)")
    assert scorers.math_verify_score("\\boxed{2\\sqrt{2}}", "\\sqrt{8}") == 1.0


# ---------------------------------------------------------------------------------------------
# Parity with verl on generated cases.

_PRIME_ATOMS = (
    "$5", "5%", "5\\%", "12.5%", "101_2", "x_1", "7_8", "\\pi", "2\\pi", "\\frac{\\pi}{2}",
    "\\pi/2", "-\\pi", "(\\pi, 2)", "3.14", "6.28", "6.2832", "1.5707", "Point(1, 2)", "(1,2)",
    "(1, 2)", "[1, 2]", "[0,1)", "Interval(0, 1)", "Interval.Ropen(0, 1)", "Interval.open(1, 3)",
    "(1,3)", "1,000", "1,000,000", "1000", "2 million", "2000000", "7 3/4", "31/4", "7\\frac34",
    "\\text{(A)}", "(A)", "A", "Monday", "3 days", "3", "5 liters", "5 cm^2", "5 meters",
    "2x+2", "2(x+1)", "x^2+2x+1", "(x+1)^2", "x^{2}", "\\sqrt{8}", "2\\sqrt{2}", "2.828",
    "\\frac{\\sqrt{3}}{2}", "\\sqrt{3}/2", "0.866", "1/3", "0.3333", "2/4", "1/2", "0.5", "50",
    "x=2", "y = 2", "\\{1,2\\}", "1, 2", "2, 1", "1 and 2", "1 or 2", "-5", "- 5", "5.0", "5.00",
    "1e3", "inf", "\\infty", "Matrix([[1], [2]])", "[[1], [2]]", "[1, 2]", "Matrix([1, 2])",
    "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "None", "", "10^{10}", "x^10", "\\$5.00",
    "5^\\circ", "30 degrees", "\\text{5 cm}", "{5}", "5,\\!000", "abc", "a+b", "\\mathrm{cm}",
)  # fmt: skip


def _prime_answer(r):
    if r.random() < 0.6:
        return r.choice(_PRIME_ATOMS)
    return base._perturb(r, base._atom(r)) if r.random() < 0.5 else base._atom(r)


# Answers that some of verl's checks take for equal and others not: pairs drawn from one group
# reach the later, quirkier checks (units, bases, pi = 3.14, percent scaling, Point, Matrix).
_PRIME_GROUPS = (
    ("5", "5 liters", "5 cm", "$5", "5%", "5.0", "5\\%", "\\$5.00", "{5}", "5^\\circ", "101_5",
     "5 degrees", "\\text{5 cm}", "5 seconds", "5 milliseconds", "0.05", "500", "5_x"),
    ("\\pi", "3.14", "3.1416", "3.141", "1\\pi", "\\pi/1", "pi"),
    ("2\\pi", "6.28", "6.2832", "2 \\pi", "(\\pi, 2)", "(3.14, 2)", "(3.1416,2)"),
    ("(1,2)", "(1, 2)", "Point(1, 2)", "[1,2]", "Point(1,2)", "(1,2,3)", "Point(1, 2, 3)"),
    ("[0,1]", "Interval(0, 1)", "[0, 1]", "Interval.Ropen(0, 1)", "[0,1)", "(0,1]"),
    ("1000", "1,000", "1000.0", "1,000.00", "1 000", "1e3"),
    ("2000000", "2 million", "2,000,000", "2\\text{ million}"),
    ("31/4", "7 3/4", "7\\frac34", "7.75", "7\\frac{3}{4}"),
    ("0.5", "1/2", "\\frac12", "50", "50%", "2/4", "\\dfrac{1}{2}", ".5"),
    ("\\sqrt{8}", "2\\sqrt{2}", "2.828", "2.8284", "\\sqrt8"),
    ("2x+2", "2(x+1)", "2 x + 2", "x+x+2", "2y+2"),
    ("Matrix([[1], [2]])", "[[1], [2]]", "[1, 2]", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}",
     "Matrix([1, 2])", "[[1, 2]]"),
    ("\\text{(A)}", "(A)", "A", "a", "\\textbf{A}"),
    ("Monday", "monday", "\\text{Monday}", "Mon"),
    ("1, 2", "2, 1", "1 and 2", "\\{1,2\\}", "1 or 2", "1,2"),
)  # fmt: skip


def _prime_pair(r):
    if r.random() < 0.5:
        group = r.choice(_PRIME_GROUPS)
        return r.choice(group), r.choice(group)
    gt = _prime_answer(r)
    pred = gt if r.random() < 0.3 else _prime_answer(r)
    if r.random() < 0.3:
        pred = base._perturb(r, pred)
    return pred, gt


def _prime_completion(r, a):
    decoy = _prime_answer(r)
    templates = [
        lambda: f"The answer is {a}",
        lambda: f"The answer is $\\boxed{{{a}}}$.",
        lambda: f"Step 1: think. Step 2: so \\boxed{{{a}}}",
        lambda: f"answer: {a}",
        lambda: f"ANSWER: {decoy}\nThe answers are {a}",
        lambda: f"{a} is the answer. Really",
        lambda: f"we get {a}",
        lambda: f"so x = {a}",
        lambda: f"it must be\n{a}",
        lambda: f"\\boxed{{{decoy}}} no wait \\boxed{{{a}}}",
        lambda: f"\\fbox{{{a}}}",
        lambda: f"\\boxed{{}} then {a}",
        lambda: f"The result is {a}. Done. ",
        lambda: f"{a}",
        lambda: f"answer is: {a}. So is {decoy}",
    ]
    return base._prefix(r) + r.choice(templates)()


def _prime_cases(seed, n):
    r = random.Random(seed)
    return [(_prime_completion(r, p), g) for p, g in (_prime_pair(r) for _ in range(n))]


N_PRIME, N_PRIME_MATCH, N_GRADE, N_GEO3K, N_QA, N_DISPATCH = 300, 3000, 400, 800, 3000, 300


def test_prime_math_parity_generated(verl):
    cases = _prime_cases(10, N_PRIME)
    fn = reference.fn(RS + "prime_math:compute_score")
    theirs = base._verl_values(verl, (fn(s, g) for s, g in cases))
    ours = [prime_math.prime_math_score(s, g) for s, g in cases]
    base._assert_all_equal("prime_math", cases, ours, theirs)
    hits = sum(o[0] for o in ours)
    assert 0.1 * len(cases) < hits < 0.9 * len(cases)


def test_prime_math_helpers_parity_generated(verl):
    """match_answer and math_equal on their own, with both values of pi."""
    cases = _prime_cases(11, N_PRIME_MATCH)
    fn = reference.fn(RS + "prime_math:match_answer")
    theirs = base._verl_values(verl, (fn(s) for s, _ in cases))
    ours = [prime_math.match_answer(s) for s, _ in cases]
    base._assert_all_equal("match_answer", cases, ours, theirs)
    r = random.Random(12)
    pairs = [(*_prime_pair(r), r.choice([math.pi, 3.14])) for _ in range(N_GRADE)]
    # verl's math_equal raises where ours does; compare "raised" as a value.
    eq = reference.fn(RS + "prime_math.grader:math_equal")
    theirs = []
    for p, g, pi in pairs:
        try:
            theirs.append(verl.run(eq(p, g, timeout=True, pi=pi)).value)
        except reference.WorkerError:
            theirs.append("raised")
    ours = []
    for p, g, pi in pairs:
        try:
            ours.append(prime_math.math_equal(p, g, pi=pi))
        except Exception:  # noqa: BLE001 - compared with verl's raise
            ours.append("raised")
    base._assert_all_equal("math_equal", pairs, ours, theirs)


def test_prm800k_grade_answer_parity_generated(verl):
    r = random.Random(13)
    pairs = [_prime_pair(r) for _ in range(N_GRADE)]
    for variant, module in (("prime_math", RS + "prime_math:"), ("mathruler", "mathruler.grader:")):
        grade = reference.fn(module + "grade_answer")
        theirs = base._verl_values(verl, (grade(p, g) for p, g in pairs))
        ours = [prm800k.grade_answer(p, g, variant=variant) for p, g in pairs]
        base._assert_all_equal(f"grade_answer[{variant}]", pairs, ours, theirs)
        assert 0.1 * len(pairs) < sum(ours) < 0.9 * len(pairs)
        norm = reference.fn(module.replace("grader:", "math_normalize:") + "normalize_answer")
        if variant == "prime_math":
            norm = reference.fn(RS + "prime_math.math_normalize:normalize_answer")
        answers = [a for pair in pairs for a in pair]
        theirs = base._verl_values(verl, (norm(a) for a in answers))
        ours = [prm800k.mathd_normalize(a, variant=variant) for a in answers]
        base._assert_all_equal(f"normalize_answer[{variant}]", answers, ours, theirs)


def _geo3k_cases(seed, n):
    r = random.Random(seed)
    cases = []
    for _ in range(n):
        pred, gt = _prime_pair(r)
        body = _prime_completion(r, pred)
        if r.random() < 0.5:
            body = f"\\boxed{{{pred}}}" if r.random() < 0.3 else body
        think = r.choice(["<think>reasoning</think>", "<think>\n\\boxed{1}\n</think>\n", "", " "])
        kwargs = {}
        if r.random() < 0.2:
            kwargs["use_boxed"] = False
        if r.random() < 0.2:
            kwargs["format_score"] = r.choice([0.0, 0.2, 0.5])
        cases.append((think + body, gt, kwargs))
    return cases


def test_geo3k_parity_generated(verl):
    try:
        verl.run(reference.after(reference.fn("importlib:import_module")("mathruler.grader"), 1))
    except reference.WorkerError as e:
        reference.require("verl", f"verl's geo3k needs mathruler in verl's venv: {e}")
    cases = _geo3k_cases(14, N_GEO3K)
    fn = reference.fn(RS + "geo3k:compute_score")
    theirs = base._verl_values(verl, (fn(s, g, **kw) for s, g, kw in cases))
    ours = [geo3k.geo3k_score(s, g, **kw) for s, g, kw in cases]
    base._assert_all_equal("geo3k", cases, ours, theirs)
    assert len(set(ours)) >= 4
    extract = reference.fn("mathruler.grader:extract_boxed_content")
    theirs = base._verl_values(verl, (extract(s) for s, _, _ in cases))
    ours = [geo3k.extract_boxed_content(s) for s, _, _ in cases]
    base._assert_all_equal("extract_boxed_content", cases, ours, theirs)


_QA_WORDS = ("The", "the", "a", "an", "Paris", "paris", "France", "Eiffel", "Tower", "à",
             "l'Arc", "U.S.A.", "1984", "New-York", "an", "theory", "Anne", "'", ",", ".", "!",
             "—")  # fmt: skip


def _qa_phrase(r):
    return " ".join(r.choice(_QA_WORDS) for _ in range(r.randint(1, 4)))


def _qa_cases(seed, n):
    r = random.Random(seed)
    cases = []
    for _ in range(n):
        golds = [_qa_phrase(r) for _ in range(r.randint(1, 3))]
        pred = r.choice(golds) if r.random() < 0.5 else _qa_phrase(r)
        if r.random() < 0.4:
            pred = r.choice(["", " ", "The ", "\n"]) + pred + r.choice(["", ".", " !", "\n"])
        answer = f"<answer>{pred}</answer>"
        text = r.choice(
            [
                f"<think>x</think>{answer}",
                f"<answer>{_qa_phrase(r)}</answer> then {answer}",
                answer * r.choice([1, 10, 11, 12]),
                f"{answer}<answer>",
                f"<answer>{pred}",
                pred,
                answer + "</answer>" * r.choice([9, 10, 11]),
            ]
        )
        target = r.choice([golds, golds[0], tuple(golds)])
        kwargs = {"format_score": 0.2} if r.random() < 0.3 else {}
        cases.append((text, {"target": target}, kwargs))
    return cases


def test_qa_em_parity_generated(verl):
    cases = _qa_cases(15, N_QA)
    for ours_fn, name in ((qa_em.qa_em_score, "compute_score"),
                          (qa_em.qa_subem_score, "compute_score_subem")):  # fmt: skip
        fn = reference.fn(RS + "search_r1_like_qa_em:" + name)
        theirs = base._verl_values(verl, (fn(s, g, **kw) for s, g, kw in cases))
        ours = [ours_fn(s, g, **kw) for s, g, kw in cases]
        base._assert_all_equal(name, cases, ours, theirs)
        assert len(set(ours)) >= 3


NEW_SOURCES = scorers.PRIME_MATH_SOURCES + scorers.GEO3K_SOURCES + scorers.SEARCH_R1_SOURCES


def test_default_compute_score_new_sources_parity_generated(verl):
    r = random.Random(16)
    qa = _qa_cases(17, N_DISPATCH)
    cases = []
    for i in range(N_DISPATCH):
        source = NEW_SOURCES[i % len(NEW_SOURCES)]
        if source in scorers.SEARCH_R1_SOURCES:
            completion, gt, _ = qa[i]
        else:
            pred, gt = _prime_pair(r)
            completion = r.choice(["<think>x</think>", ""]) + _prime_completion(r, pred)
        cases.append((source, completion, gt))
    fn = reference.fn(RS[:-1] + ":default_compute_score")
    theirs = base._verl_values(verl, (fn(d, s, g) for d, s, g in cases))
    ours = [scorers.default_compute_score(d, s, g) for d, s, g in cases]
    base._assert_all_equal("default_compute_score", cases, ours, theirs)
    assert {type(o) for o in ours} == {float}
