"""Reward functions of the train.py runs in test_faults.py and test_bad_input.py, in a module of
their own: each reward worker process imports the module a function comes from, and this one
imports nothing heavy (test_faults.py imports JAX and the multi-turn tests: 4 s a worker)."""

import math


def digit_reward(solution_str: str, ground_truth: str) -> float:
    """Fraction of digit characters in the completion: dense and text-dependent (test reward)."""
    del ground_truth
    return sum(ch.isdigit() for ch in solution_str) / max(len(solution_str), 1)


def failing_reward(solution_str: str, ground_truth: str) -> float:
    """Raises on completions of odd length, returns NaN on even ones: every call fails
    (tests/test_bad_input.py)."""
    del ground_truth
    if len(solution_str) % 2:
        raise ZeroDivisionError("odd length")
    return math.nan
