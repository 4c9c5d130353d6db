"""verl 0.9.1's code scorers for tests/test_code_reward.py, run in the reference worker
(tests/reference.py) under verl's interpreter; only the standard library at the top."""

from __future__ import annotations


def prime_code_score(completion, test_cases, *, first_pass_timeout_s=5, per_test_timeout_s=10):
    """verl's prime_code.compute_score(continuous=True) with its two timeouts (5 s for the
    first pass, 10 s a test) replaced, so that the tests' infinite loops end sooner."""
    from verl.utils.reward_score import prime_code

    original = prime_code.apps_check_correctness
    timeouts = {5: first_pass_timeout_s, 10: per_test_timeout_s}

    def shortened(*, in_outs, generation, timeout, debug):
        return original(in_outs=in_outs, generation=generation, timeout=timeouts[timeout],
                        debug=debug)  # fmt: skip

    prime_code.apps_check_correctness = shortened
    try:
        return prime_code.compute_score(completion, test_cases, continuous=True)
    finally:
        prime_code.apps_check_correctness = original


def raises(path: str, *args, **kwargs) -> str | None:
    """The name of the exception `module:function`(*args, **kwargs) raises, None if none."""
    import importlib

    module, _, name = path.partition(":")
    try:
        getattr(importlib.import_module(module), name)(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported by name
        return type(e).__name__
    return None
