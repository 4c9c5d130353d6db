"""Benchmark (GPU): vLLM sidecar weight push, disk export + reload vs the NCCL in-memory transfer.

Random weights of Qwen2.5-0.5B's shape (tied, V=151936, D=896, 24 layers), bf16. One vLLM server
is started with `--weight-transfer-config '{"backend": "nccl"}'`; a managed sidecar pushes through
disk exports (`weight_transfer="disk"`: hf_export.save + reload_weights + prefix-cache reset),
then a second sidecar attached to the same server pushes over NCCL (`weight_transfer="nccl"`).
Both push the same weights last, so their greedy outputs must be equal token for token
(`nccl_matches_disk`). Prints one JSON line: the export alone, each push (median, min, max),
the server start, which transfer the NCCL sidecar ended up using (and why, if it fell back).

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 python benchmarks/bench_vllm_push.py --python $VLLM_PY
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import model
from grpo_jax.models import hf
from grpo_jax.rollout import vllm_sidecar


def _stats(xs):
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3),
            "max": round(max(xs), 3), "n": len(xs)}  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--python", required=True, help="interpreter of a GPU vLLM venv")
    p.add_argument("--pushes", type=int, default=3, help="per sidecar, >= 1")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    args = p.parse_args()

    config = model.ModelConfig(
        arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
        num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1e6, tie_word_embeddings=True,
        max_position_embeddings=4096, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
    )  # fmt: skip
    versions = [model.init_params(config, jax.random.key(k)) for k in range(2)]
    # Both sidecars start from versions[0] and push v1, v0, v1, ...: they end on the same weights.
    sequence = [versions[(i + 1) % 2] for i in range(args.pushes)]
    rng = np.random.default_rng(0)
    prompt_ids = rng.integers(1, config.vocab_size, (8, 16), dtype=np.int32)
    greedy = {"n": 1, "max_new_tokens": 32, "temperature": 0.0}
    out = {"check": "vllm_push", "model": "random Qwen2.5-0.5B shape, tied, bfloat16"}

    with tempfile.TemporaryDirectory() as workdir:
        t = time.perf_counter()
        hf.save(config, versions[0], os.path.join(workdir, "export"), untie_embeddings=True)
        out["export_s"] = round(time.perf_counter() - t, 3)
        out["export_mb"] = round(
            sum(e.stat().st_size for e in os.scandir(os.path.join(workdir, "export"))) / 2**20, 1
        )
        common = {"dtype": "bfloat16", "max_model_len": 1024, "startup_timeout_s": 900}
        disk_cfg = vllm_sidecar.VLLMConfig(
            python=args.python,
            gpu_memory_utilization=args.gpu_memory_utilization,
            extra_args=("--weight-transfer-config", '{"backend": "nccl"}'),
            **common,
        )
        disk = vllm_sidecar.VLLMSidecar(disk_cfg, config, os.path.join(workdir, "disk"))
        nccl = None
        try:
            t = time.perf_counter()
            disk.start(versions[0])
            out["server_start_s"] = round(time.perf_counter() - t, 1)
            out["disk_push_s"] = _stats([disk.push_weights(v) for v in sequence])
            want = disk.sample(prompt_ids, np.ones_like(prompt_ids), jax.random.key(0), **greedy)

            nccl_cfg = vllm_sidecar.VLLMConfig(url=disk.url, weight_transfer="nccl", **common)
            nccl = vllm_sidecar.VLLMSidecar(nccl_cfg, config, os.path.join(workdir, "nccl"))
            nccl.start(versions[0])  # attached: a disk reload, then the NCCL group
            out["nccl_transfer"] = nccl.weight_transfer
            out["nccl_fallback_reason"] = nccl.weight_transfer_note
            out["nccl_push_s"] = _stats([nccl.push_weights(v) for v in sequence])
            got = nccl.sample(prompt_ids, np.ones_like(prompt_ids), jax.random.key(0), **greedy)
            out["nccl_matches_disk"] = bool(
                np.array_equal(np.asarray(got.response_ids), np.asarray(want.response_ids))
            )
        finally:
            if nccl is not None:
                nccl.close()
            disk.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
