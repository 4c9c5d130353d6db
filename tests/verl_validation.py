"""verl 0.9.1's validation metrics, run in the reference worker (tests/reference.py).

verl's V1 trainer turns the per-sample validation variables into its logged metrics in
`verl/trainer/ppo/v1/trainer_base.py: PPOTrainer._val_metrics_update`, which calls
`metric_utils.process_validation_metrics` and then splits the keys into val-core / val-aux.
That module cannot be imported in the verl venv (it needs the `transfer_queue` package, which
is not among verl's pins), so `val_metrics` compiles that one method from the installed file's
source and calls it, with `self` unused, exactly as `_validate` does at the end of a
validation (`expected_acc_counts` built as `_validate` builds it: the prompt's
rollout.val_kwargs.n, keyed by str(data_source), str(uid)).
This file runs under verl's interpreter and imports only the standard library at the top.
"""

from __future__ import annotations

import ast
import importlib.util


def _val_metrics_update():
    spec = importlib.util.find_spec("verl")
    path = spec.submodule_search_locations[0] + "/trainer/ppo/v1/trainer_base.py"
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "_val_metrics_update":
            import numpy as np
            from verl.trainer.ppo import metric_utils

            namespace = {
                "np": np,
                "process_validation_metrics": metric_utils.process_validation_metrics,
            }
            module = ast.Module(body=[node], type_ignores=[])
            exec(compile(module, path, "exec"), namespace)  # noqa: S102 - verl's own source
            return namespace["_val_metrics_update"]
    raise LookupError(f"no _val_metrics_update in {path}")


def val_metrics(data_sources, sample_uids, variables, num_turns, n):
    """verl's V1 validation metrics dict of these samples (n samples per uid)."""
    expected = {(str(s), str(u)): n for s, u in zip(data_sources, sample_uids, strict=True)}
    update = _val_metrics_update()
    out = update(None, list(data_sources), list(sample_uids), dict(variables), list(num_turns),
                 expected_acc_counts=expected)  # fmt: skip
    return {k: float(v) for k, v in out.items()}
