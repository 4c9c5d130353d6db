"""GGUF checkpoints (llama.cpp's format): metadata -> ModelConfig, tensors -> params, tokenizer.

This module owns reading GGUF files without torch: the hyper-parameters in the GGUF metadata
become a ``config_lib.ModelConfig``, the tensors become params in the layout of ``hf.HF_TO_JAX``,
and the tokenizer stored in the same file becomes a transformers tokenizer. ``load`` is the
entry point (``grpo_jax.model.load`` and ``load_gguf`` call it).

Design:
  * Tensors are read with ``gguf.GGUFReader`` (a memory map) and dequantised one at a time in
    numpy with ``gguf.quants.dequantize``, so every type gguf-py knows (F32, F16, BF16, Q4_0,
    Q4_1, Q8_0, the K-quants, ...) loads. The weights are then cast to the param dtype and never
    re-quantised: a Q4_1 file gives a float32 model whose weights are the Q4_1-rounded values.
  * GGUF names map onto HF names (``HF_TO_GGUF``, the names of llama.cpp's convert_hf_to_gguf.py)
    and from there onto params through ``hf.HF_TO_JAX``, so GGUF and safetensors share one
    layout table. A dequantised GGUF tensor has the HF torch shape ([out, in] for a Linear).
  * llama.cpp rotates adjacent pairs in its Llama rope kernel, while HF (and
    grpo_jax.models.transformer) rotate halves, so its converter permutes the rows of Llama
    q/k weights within each head (``LlamaModel.permute``); they are permuted back here. Qwen2
    and Qwen3 use llama.cpp's "neox" rope, which rotates halves, and their weights are stored
    unpermuted.
  * Llama 3 rope scaling is stored as per-frequency divisors (the ``rope_freqs.weight`` tensor),
    not as metadata. They are mapped back to HF's ``llama3`` rope parameters and checked to
    reproduce every divisor; anything else is refused.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np

from grpo_jax.models import config as config_lib
from grpo_jax.models import hf, transformer

# GGUF general.architecture -> ModelConfig.arch (the same names).
ARCHITECTURES = ("llama", "qwen2", "qwen3")

# HF tensor name (the templates of hf.HF_TO_JAX) -> GGUF tensor name, as written by
# llama.cpp's convert_hf_to_gguf.py (gguf-py's TensorNameMap). "{i}" is the layer index.
HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.q_proj.bias": "blk.{i}.attn_q.bias",
    "model.layers.{i}.self_attn.k_proj.bias": "blk.{i}.attn_k.bias",
    "model.layers.{i}.self_attn.v_proj.bias": "blk.{i}.attn_v.bias",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}
# Llama 3 rope scaling (per-frequency divisors of the rotary frequencies), handled by _rope.
_ROPE_FREQS = "rope_freqs.weight"
# llama3 rope parameters that every Llama 3.x release uses (and the converter's defaults).
_LLAMA3_LOW_FREQ_FACTOR, _LLAMA3_HIGH_FREQ_FACTOR, _LLAMA3_ORIGINAL_CONTEXT = 1.0, 4.0, 8192
_REQUIRED = object()


def _gguf_regex(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(\d+)") + "$")


class _Reader(gguf.GGUFReader):
    """gguf's reader over a plain ndarray view of its memory map: the reader slices the file
    once per metadata string (about 300k times for a 49k vocabulary), and a slice of a
    ``np.memmap`` is a memmap whose bookkeeping costs 3x the parse (2.3 -> 0.7 s for SmolLM2)."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value) -> None:
        self._data = np.asarray(value)  # the same pages, no copy; keeps the map alive


def _open(path: str | os.PathLike) -> tuple[str, gguf.GGUFReader]:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"GGUF checkpoint {path!r} is not a file")
    return path, _Reader(path)


def _get(reader: gguf.GGUFReader, path: str, key: str, default: Any = _REQUIRED) -> Any:
    """A scalar metadata value; `default` when absent (an error when there is none)."""
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"GGUF {path!r} lacks the metadata key {key!r}")
        return default
    value = field.contents()
    if field.types[0] == gguf.GGUFValueType.FLOAT32:
        # GGUF stores float32. The shortest decimal that rounds to the same float32 gives back the
        # config.json value (1e-06, not 9.99999997e-07); it is the same float32 in any computation.
        value = float(str(np.float32(value)))
    if isinstance(value, list):  # e.g. per-layer head counts (OpenELM-style models).
        # An unsupported feature of the file, not a caller's type error: ValueError like the rest.
        msg = f"GGUF {path!r}: metadata {key!r} is a per-layer list, unsupported"
        raise ValueError(msg)  # noqa: TRY004
    return value


def _dequantized(tensor) -> np.ndarray:
    """The tensor as float32 numpy in HF/torch order (GGUF lists dimensions innermost first)."""
    x = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(x, np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))


def read_config(path: str | os.PathLike, *, dtype=jnp.float32) -> config_lib.ModelConfig:
    """The ModelConfig described by a GGUF file's metadata (reads no weights).

    Raises:
      ValueError: an unsupported architecture or feature (named), or missing metadata.
    """
    path, reader = _open(path)
    return _config(reader, path, dtype)


def _config(reader: gguf.GGUFReader, path: str, dtype) -> config_lib.ModelConfig:
    arch = _get(reader, path, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF {path!r}: general.architecture={arch!r} is not supported; expected one of "
            f"{sorted(ARCHITECTURES)}"
        )

    def key(name: str, default: Any = _REQUIRED) -> Any:
        return _get(reader, path, f"{arch}.{name}", default)

    if key("expert_count", 0):
        raise ValueError(
            f"GGUF {path!r}: {arch}.expert_count > 0 (mixture of experts) is unsupported"
        )
    if key("attention.sliding_window", None) is not None:
        raise ValueError(f"GGUF {path!r}: {arch}.attention.sliding_window is unsupported")
    hidden_size = key("embedding_length")
    num_heads = key("attention.head_count")
    # llama.cpp's defaults when the keys are absent: K = N, H = D / N.
    num_kv_heads = key("attention.head_count_kv", num_heads)
    head_dim = key("attention.key_length", hidden_size // num_heads)
    if key("attention.value_length", head_dim) != head_dim:
        raise ValueError(
            f"GGUF {path!r}: {arch}.attention.value_length != key_length ({head_dim}) is "
            "unsupported"
        )
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(
            f"GGUF {path!r}: {arch}.rope.dimension_count={key('rope.dimension_count')} is not "
            f"head_dim={head_dim} (partial rotary embedding is unsupported)"
        )
    tensors = {t.name: t for t in reader.tensors}
    if key("vocab_size", None) is not None:
        vocab_size = key("vocab_size")
    elif "tokenizer.ggml.tokens" in reader.fields:  # Qwen2's converter writes no vocab_size.
        vocab_size = len(reader.fields["tokenizer.ggml.tokens"].data)
    elif "token_embd.weight" in tensors:  # A file without a tokenizer.
        vocab_size = int(tensors["token_embd.weight"].shape[-1])
    else:
        raise ValueError(f"GGUF {path!r} is missing tensor 'token_embd.weight'")
    # llama.cpp stops generation at any end-of-generation token: eos, and eot / eom when set.
    eos_ids = []
    for name in ("eos", "eot", "eom"):
        token = _get(reader, path, f"tokenizer.ggml.{name}_token_id", None)
        if token is not None and token not in eos_ids:
            eos_ids.append(token)
    config = config_lib.ModelConfig(
        arch=arch,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=float(key("rope.freq_base", 10000.0)),  # llama.cpp's default base.
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        max_position_embeddings=key("context_length"),
        dtype=dtype,
        param_dtype=dtype,
        bos_token_id=_get(reader, path, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=tuple(eos_ids),
        pad_token_id=_get(reader, path, "tokenizer.ggml.padding_token_id", None),
    )
    rope_scaling = _rope_scaling(reader, path, config, tensors.get(_ROPE_FREQS))
    return (
        config if rope_scaling is None else dataclasses.replace(config, rope_scaling=rope_scaling)
    )


def _rope_scaling(reader, path: str, config: config_lib.ModelConfig, rope_freqs) -> dict | None:
    """HF rope_scaling ({"rope_type": ...}) from the rope.scaling.* keys or rope_freqs.weight."""
    arch = config.arch
    kind = _get(reader, path, f"{arch}.rope.scaling.type", "none")
    # Files from before rope.scaling.type stored a linear factor alone.
    scale_linear = _get(reader, path, f"{arch}.rope.scale_linear", None)
    if kind == "none" and scale_linear not in (None, 1.0):
        kind, factor = "linear", scale_linear
    elif kind == "linear":
        factor = _get(reader, path, f"{arch}.rope.scaling.factor")
    elif kind != "none":
        raise ValueError(
            f"GGUF {path!r}: {arch}.rope.scaling.type={kind!r} is not supported "
            "(supported: none, linear, and llama3 as rope_freqs.weight)"
        )
    if rope_freqs is None:
        return None if kind == "none" else {"rope_type": "linear", "factor": float(factor)}
    if kind != "none":
        raise ValueError(
            f"GGUF {path!r} has both {arch}.rope.scaling.type={kind!r} and {_ROPE_FREQS!r}"
        )
    divisors = _dequantized(rope_freqs).reshape(-1).astype(np.float64)
    if divisors.shape != (config.head_dim // 2,):
        raise ValueError(
            f"GGUF tensor {_ROPE_FREQS!r} has shape {divisors.shape}, expected "
            f"({config.head_dim // 2},) from head_dim={config.head_dim}"
        )
    if np.all(divisors == 1.0):
        return None
    return _llama3_from_divisors(path, config, divisors)


def _llama3_from_divisors(path: str, config: config_lib.ModelConfig, divisors: np.ndarray) -> dict:
    """HF llama3 rope parameters whose frequencies are inv_freq / divisors (checked).

    convert_hf_to_gguf.py writes divisor 1 for wavelengths below original/high_freq_factor,
    ``factor`` above original/low_freq_factor, and 1 / ((1 - s) / factor + s) in between, with
    s = (original / wavelen - low) / (high - low). With Meta's low = 1 and high = 4, each
    in-between divisor gives ``original`` back; without one, Meta's 8192 is assumed. The result
    is accepted only if it reproduces every divisor.
    """
    factor = float(divisors.max())
    base = transformer.rope_inv_freq(dataclasses.replace(config, rope_scaling=None)).astype(
        np.float64
    )
    wavelen = 2 * math.pi / base
    low, high = _LLAMA3_LOW_FREQ_FACTOR, _LLAMA3_HIGH_FREQ_FACTOR
    middle = (divisors > 1.0) & (divisors < factor)
    if np.any(middle):
        smooth = (1 / divisors[middle] - 1 / factor) / (1 - 1 / factor)
        original = float(np.median(wavelen[middle] * (low + smooth * (high - low))))
        original = round(original) if abs(original - round(original)) < 1e-3 else original
    else:
        original = _LLAMA3_ORIGINAL_CONTEXT
    rope = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }
    ours = transformer.rope_inv_freq(dataclasses.replace(config, rope_scaling=rope)).astype(
        np.float64
    )
    if not np.allclose(ours, base / divisors, rtol=1e-5, atol=0):
        raise ValueError(
            f"GGUF {path!r}: {_ROPE_FREQS!r} does not match llama3 rope scaling with "
            f"low_freq_factor={low}, high_freq_factor={high} (divisors {divisors.tolist()})"
        )
    return rope


def _unpermute(w_OI: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf.py's ``LlamaModel.permute`` on rows [n_heads * H, ...].

    The converter reorders each head's rows from halves (HF: x[:H/2] pairs with x[H/2:]) to
    interleaved pairs (row 2j pairs with 2j+1): reshape (n, 2, H/2) -> swap -> (n, H/2, 2).
    """
    rows = w_OI.shape[0]
    w = w_OI.reshape(n_heads, rows // n_heads // 2, 2, *w_OI.shape[1:])
    return w.swapaxes(1, 2).reshape(w_OI.shape)


def load(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    shardings: Callable[[config_lib.ModelConfig, Any], Any] | None = None,
) -> tuple[config_lib.ModelConfig, dict]:
    """Reads a llama.cpp GGUF checkpoint (Llama/SmolLM2, Qwen2, Qwen3) into params, without torch
    (``grpo_jax.model.load_gguf``).

    The hyper-parameters come from the GGUF metadata. Quantised tensors (Q4_0, Q4_1, Q8_0,
    K-quants, F16, BF16, ...) are dequantised in numpy with ``gguf.quants.dequantize`` and cast
    to ``dtype``, so the params are an ordinary float model holding the file's rounded weights.

    Args:
      path: the ``.gguf`` file (one file; split ``-00001-of-0000N.gguf`` sets are unsupported).
      dtype: param and compute dtype of the returned config; dequantised weights are cast to it.
      shardings: optional ``(config, abstract_params) -> pytree of jax.sharding.Sharding``; each
        param is placed with ``jax.device_put`` as soon as it is built, so host memory holds one
        (layer-stacked) param at a time.

    Returns:
      (config, params).

    Raises:
      ValueError: unsupported architecture or feature, or a missing, unexpected or mis-shaped
        tensor (named).
    """
    path, reader = _open(path)
    if _get(reader, path, "split.count", 1) > 1:
        raise ValueError(f"GGUF {path!r} is one shard of a split file (split.count), unsupported")
    config = _config(reader, path, dtype)
    abstract = transformer.abstract_params(config)
    flat_abstract = dict(transformer.flatten_params(abstract))
    flat_shardings = (
        dict(transformer.flatten_params(shardings(config, abstract))) if shardings else {}
    )
    tensors = {t.name: t for t in reader.tensors}
    wanted = {
        HF_TO_GGUF[template] for template, jax_name, _ in hf.HF_TO_JAX if jax_name in flat_abstract
    }
    patterns = [_gguf_regex(name) for name in sorted(wanted)]
    unexpected = [
        name
        for name in tensors
        if name != _ROPE_FREQS
        and not any(
            (m := p.match(name)) and (not m.groups() or int(m.group(1)) < config.num_layers)
            for p in patterns
        )
    ]
    if unexpected:
        raise ValueError(f"{config.arch} GGUF {path!r} has unexpected tensors {unexpected[:8]}")

    flat = {}
    for template, jax_name, layout in hf.HF_TO_JAX:
        if jax_name not in flat_abstract:
            continue
        spec = flat_abstract[jax_name]
        layered = "{i}" in template
        shape = spec.shape[1:] if layered else spec.shape
        want = hf.hf_shape(layout, shape)
        parts = []
        for i in range(config.num_layers) if layered else [-1]:
            name = HF_TO_GGUF[template].format(i=i)
            if name not in tensors:
                raise ValueError(f"{config.arch} GGUF {path!r} is missing tensor {name!r}")
            x = _dequantized(tensors[name])
            if x.shape != want:
                raise ValueError(
                    f"{config.arch} GGUF tensor {name!r} has shape {x.shape} (torch order), "
                    f"expected {want} from the GGUF metadata"
                )
            if config.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
                n = config.num_heads if ".attn_q." in name else config.num_kv_heads
                x = _unpermute(x, n)
            parts.append(hf.from_hf_layout(layout, x, shape).astype(spec.dtype))
        value = np.stack(parts) if layered else parts[0]
        flat[jax_name] = hf.place(value, flat_shardings.get(jax_name))
        del parts, value
    return config, transformer.unflatten_params(flat)


def load_tokenizer(path: str | os.PathLike):
    """The transformers tokenizer stored in a GGUF file, with its chat template.

    transformers rebuilds it from the ``tokenizer.ggml.*`` metadata
    (``AutoTokenizer.from_pretrained(dirname, gguf_file=basename)``).

    Raises:
      ValueError: the file carries no tokenizer, or no chat template (``tokenizer.chat_template``),
        which the GRPO prompts need.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"GGUF checkpoint {path!r} is not a file")
    import transformers  # Deferred: only tokenizer loading needs it.

    no_template = ValueError(
        f"GGUF {path!r} has no chat template ('tokenizer.chat_template'); set "
        "tokenizer.chat_template before building chat prompts"
    )
    # transformers reads the file's metadata itself (seconds for a 49k vocabulary: gguf's reader
    # parses every string), so a good file is read once, and a failing one a second time to say
    # what it lacks.
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path)
        )
    except Exception:
        _, reader = _open(path)
        if "tokenizer.ggml.tokens" not in reader.fields:
            msg = f"GGUF {path!r} carries no tokenizer (no 'tokenizer.ggml.tokens')"
            raise ValueError(msg) from None
        if not _get(reader, path, "tokenizer.chat_template", ""):
            raise no_template from None
        raise
    if not tokenizer.chat_template:
        raise no_template
    return tokenizer
