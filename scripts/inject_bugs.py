"""Do the tolerance-bounded tests still catch real bugs? Injects each bug below into a copy of
the working tree and runs the tests that guard against its kind; each must FAIL on its
tolerance (an AssertionError from tests/numerics.py or a parity check), not crash.

    python scripts/inject_bugs.py [NAME ...]     # all bugs when no name is given

Prints one JSON line per (bug, test) and exits non-zero if a test passed with its bug in.
The tolerances are bounds in float32 ulps of the compared values' scale (tests/numerics.py);
this is the check that those bounds still sit far below what a dropped token, a wrong
normaliser, a wrong mask or position, or a wrong LoRA scale costs.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: (kind of bug, file, old text, new text, tests that must fail)
BUGS = {
    "packed-normaliser": (
        "a wrong normaliser: the packed loss divides by one token too many",
        "grpo_jax/trainer.py",
        "    num_tokens = jnp.sum(mask_all_BT)\n",
        "    num_tokens = jnp.sum(mask_all_BT) + 1.0\n",
        [
            (
                "tests/test_packing.py::test_packed_update_equals_the_unpadded_one_in_every_agg_mode"
                "[token-mean-1]"
            ),
            "tests/test_algorithms_loop.py::test_packed_loop_step_equals_the_padded_one",
        ],
    ),
    "packed-dropped-token": (
        "a dropped token: one response token of the packed micro-batches is masked out",
        "grpo_jax/trainer.py",
        "    mask_BT = mask_all_BT * in_micro_BT\n",
        "    mask_BT = (mask_all_BT * in_micro_BT).at[0, 0].set(0.0)\n",
        [
            (
                "tests/test_packing.py::test_packed_update_equals_the_unpadded_one_in_every_agg_mode"
                "[token-sum-1]"
            ),
            (
                "tests/test_packing.py::test_packed_update_equals_the_unpadded_one_in_every_agg_mode"
                "[seq-mean-token-mean-4]"
            ),
            "tests/test_lora.py::test_packed_micro_batches_give_the_padded_adapter_gradient",
        ],
    ),
    "micro-normaliser": (
        "a wrong normaliser: each micro-batch normalised by its own tokens (legacy verl)",
        "grpo_jax/trainer.py",
        "            num_tokens=num_tokens,\n            rows=mini_batch_size,\n",
        (
            "            num_tokens=jnp.sum(micro.response_mask_BT.astype(jnp.float32)) * num_micro,\n"
            "            rows=mini_batch_size,\n"
        ),
        ["tests/test_train_step.py::test_micro_batches_give_the_exact_mini_batch_token_mean"],
    ),
    "sharded-dropped-token": (
        "a dropped token on the sharded side only (a row share lost between devices)",
        "tests/test_sharding.py",
        "    state_m, metrics_m = _run_step(mesh, config, params, batch)\n",
        (
            "    mask = np.array(batch.response_mask_BT)\n"
            "    mask[0, 1] = 0\n"
            "    batch = batch.replace(response_mask_BT=mask)\n"
            "    state_m, metrics_m = _run_step(mesh, config, params, batch)\n"
        ),
        ["tests/test_sharding.py::test_train_step_on_mesh_equals_single_device"],
    ),
    "future-token": (
        "a wrong mask: each query also sees the next token",
        "grpo_jax/model.py",
        "    causal_TT = jnp.tril(jnp.ones((T, T), dtype=bool))\n    visible_BTS = causal_TT",
        "    causal_TT = jnp.tril(jnp.ones((T, T), dtype=bool), k=1)\n    visible_BTS = causal_TT",
        [
            "tests/test_model.py::test_hf_parity_and_save_roundtrip",
            "tests/test_model.py::test_cached_decode_equals_full_forward",
            "tests/test_hf_export.py::test_transformers_loads_the_export_and_writes_the_same_files",
        ],
    ),
    "decode-position": (
        "a wrong position: tokens after the first prefill are roped one position late",
        "grpo_jax/model.py",
        "    positions_BT = cache.pos_B[:, None] + _positions(mask_BT)\n",
        "    positions_BT = cache.pos_B[:, None] + _positions(mask_BT) + (cache.index > 0)\n",
        [
            "tests/test_model.py::test_cached_decode_equals_full_forward",
            "tests/test_model.py::test_chunked_prefill_equals_single_prefill",
        ],
    ),
    "sampler-temperature": (
        "a wrong temperature: recorded log-probs ignore it",
        "grpo_jax/sampler.py",
        "    log_probs_B = jnp.take_along_axis(logp_BV, tokens_B[:, None], axis=-1)[:, 0]",
        (
            "    log_probs_B = jnp.take_along_axis(jax.nn.log_softmax(logits_BV, axis=-1),"
            " tokens_B[:, None], axis=-1)[:, 0]"
        ),
        ["tests/test_sampler.py::test_log_probs_match_teacher_forced_forward"],
    ),
    "chunk-labels": (
        "a chunking error: labels shifted by one row across the chunks",
        "grpo_jax/logprobs.py",
        "    xs = (_to_bits(z_NV).reshape(chunks, rows, vocab), labels_N.reshape(chunks, rows))",
        (
            "    xs = (_to_bits(z_NV).reshape(chunks, rows, vocab),"
            " jnp.roll(labels_N, 1).reshape(chunks, rows))"
        ),
        ["tests/test_loss.py::test_chunked_matches_dense_value_and_gradient[6-float32]"],
    ),
    "lora-scale": (
        "a wrong LoRA scale: alpha / (r + 1) instead of alpha / r",
        "grpo_jax/model.py",
        "        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0\n",
        "        return self.lora_alpha / (self.lora_rank + 1) if self.lora_rank else 0.0\n",
        ["tests/test_lora.py::test_peft_export_loads_in_peft_with_our_logits"],
    ),
    "process-rows": (
        "a row share counted twice: every process holds process 0's block of each batch",
        "grpo_jax/distributed.py",
        "    start = jax.process_index() * local\n",
        "    start = 0 * local\n",
        ["tests/test_multiprocess.py::test_two_processes_train_as_one"],
    ),
}


def run(name: str) -> list[dict]:
    kind, path, old, new, tests = BUGS[name]
    results = []
    with tempfile.TemporaryDirectory(prefix=f"inject_{name}_") as tmp:
        copy = os.path.join(tmp, "repo")
        shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "runs", "__pycache__"))
        target = os.path.join(copy, path)
        with open(target) as f:
            text = f.read()
        if text.count(old) != 1:
            raise SystemExit(f"{name}: the text to replace is not exactly once in {path}")
        with open(target, "w") as f:
            f.write(text.replace(old, new))
        for test in tests:
            out = subprocess.run(
                [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", test],
                check=False, cwd=copy, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": copy},
            )  # fmt: skip
            lines = out.stdout.splitlines()
            why = next((ln.strip() for ln in lines if ln.startswith("E ")), "")
            results.append({
                "bug": name, "kind": kind, "test": test,
                "caught": out.returncode == 1 and "AssertionError" in out.stdout,
                "rc": out.returncode, "failure": why[:300],
            })  # fmt: skip
    return results


def main(names):
    missed = 0
    for name in names or list(BUGS):
        for r in run(name):
            print(json.dumps(r), flush=True)
            missed += not r["caught"]
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main(sys.argv[1:])
