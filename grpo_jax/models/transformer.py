"""The decoder-only transformer: Flax NNX modules used functionally, and its params.

Design:
  * The modules are Flax NNX, used functionally: the module tree is built once (abstractly) per
    ``ModelConfig``, and every public function takes the parameters as a plain nested dict of
    arrays (``params``) and merges them into the module graph inside the trace. So params are an
    ordinary pytree for optax, orbax and ``jax.jit``.
  * The decoder layers are stacked on a leading ``L`` axis and run with ``jax.lax.scan`` (one layer
    is compiled once, whatever the depth). Optional per-layer rematerialisation wraps the scan body
    in ``jax.checkpoint``. Decode loops (the sampler) use a per-layer form instead: the cache as
    ``GroupKVCache`` (per-layer buffers, each prompt stored once per group) and the weights as
    ``DecodeParams``, layers unrolled, so that a decode step copies neither the cache nor the
    weights (see there).
  * Every parameter carries logical axis names (``vocab``, ``embed``, ``heads``, ``kv_heads``,
    ``head_dim``, ``mlp``; the stacked layer axis is ``None``) as ``nnx.with_partitioning``
    metadata; ``logical_axes(config)`` exposes them as a pytree of ``PartitionSpec``.
  * Positions come from the attention mask (cumsum - 1), so a left-padded row gives exactly the
    logits of the unpadded row on its real tokens.
  * Activations carry ``nn.with_logical_constraint`` annotations at five points (embedding out,
    queries, attention out, MLP hidden, logits). They are no-ops unless the caller activates logical
    axis rules (``nn.logical_axis_rules``) under a mesh; the mesh and rules belong to sharding.py.
  * Computation happens in ``config.dtype`` (float32 unless the caller asks otherwise); softmax,
    RMSNorm statistics and the logits are always float32.

Params structure (``N`` query heads, ``K`` kv heads, ``H`` head dim, ``F`` MLP width)::

    embed/embedding                [V, D]        (vocab, embed)
    layers/input_norm/scale        [L, D]        (None, embed)
    layers/attn/q_proj/kernel      [L, D, N, H]  (None, embed, heads, head_dim)
    layers/attn/q_proj/bias        [L, N, H]     only when config.qkv_bias
    layers/attn/k_proj/kernel      [L, D, K, H]  (None, embed, kv_heads, head_dim)  (+ bias)
    layers/attn/v_proj/kernel      [L, D, K, H]  (+ bias)
    layers/attn/o_proj/kernel      [L, N, H, D]  (None, heads, head_dim, embed)
    layers/attn/q_norm/scale       [L, H]        only when config.qk_norm (Qwen3)
    layers/attn/k_norm/scale       [L, H]
    layers/post_attn_norm/scale    [L, D]
    layers/mlp/gate_proj/kernel    [L, D, F]     (None, embed, mlp)
    layers/mlp/up_proj/kernel      [L, D, F]
    layers/mlp/down_proj/kernel    [L, F, D]     (None, mlp, embed)
    final_norm/scale               [D]
    lm_head/kernel                 [D, V]        only when not config.tie_word_embeddings
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

from grpo_jax.models import attention, moe
from grpo_jax.models import config as config_lib
from grpo_jax.models import matmul as matmul_lib


def _param(rngs, init, shape, axes, dtype) -> nnx.Param:
    """A parameter with logical axis names as metadata (not sharded here: names are logical)."""
    init = nnx.with_partitioning(init, axes)
    return nnx.Param(init(rngs.params(), shape, dtype), eager_sharding=False)


class RMSNorm(nnx.Module):
    """HF LlamaRMSNorm: float32 statistics, then the weight times the input-dtype result."""

    def __init__(self, dim: int, axis: str, *, eps: float, dtype, param_dtype, rngs: nnx.Rngs):
        self.scale = _param(rngs, nnx.initializers.ones, (dim,), (axis,), param_dtype)
        self.eps, self.dtype = eps, dtype

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(self.dtype)
        return y.astype(self.dtype) * scale.reshape((1,) * (y.ndim - 1) + scale.shape)


class Attention(nnx.Module):
    """Grouped-query self-attention projections (with Qwen2 bias, Qwen3 q/k norm)."""

    def __init__(self, config: config_lib.ModelConfig, *, rngs: nnx.Rngs):
        c = config
        D, N, K, H = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        w_init = nnx.initializers.normal(c.initializer_range)
        pdt = c.param_dtype
        q_axes, kv_axes, bias = (
            ("embed", "heads", "head_dim"),
            ("embed", "kv_heads", "head_dim"),
            c.qkv_bias,
        )
        lora = functools.partial(_lora_args, c)
        self.q_proj = Proj(rngs, w_init, (D, N, H), q_axes, pdt, bias=bias, **lora("q_proj"))
        self.k_proj = Proj(rngs, w_init, (D, K, H), kv_axes, pdt, bias=bias, **lora("k_proj"))
        self.v_proj = Proj(rngs, w_init, (D, K, H), kv_axes, pdt, bias=bias, **lora("v_proj"))
        o_axes = ("heads", "head_dim", "embed")
        self.o_proj = Proj(rngs, w_init, (N, H, D), o_axes, pdt, num_in=2, **lora("o_proj"))
        if c.qk_norm:
            kw = {"eps": c.rms_norm_eps, "dtype": c.dtype, "param_dtype": pdt, "rngs": rngs}
            self.q_norm = RMSNorm(H, "head_dim", **kw)
            self.k_norm = RMSNorm(H, "head_dim", **kw)
        self.config = config

    def qkv(self, x_BTD, cos_BTH, sin_BTH):
        """Rotary-embedded queries [B,T,N,H] and keys/values [B,T,K,H]."""
        dt = self.config.dtype
        q_BTNH = self.q_proj("BTD,DNH->BTNH", x_BTD, dt)
        k_BTKH = self.k_proj("BTD,DKH->BTKH", x_BTD, dt)
        v_BTKH = self.v_proj("BTD,DKH->BTKH", x_BTD, dt)
        if self.config.qk_norm:  # Qwen3: per-head RMSNorm before RoPE.
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        return apply_rope(q_BTNH, cos_BTH, sin_BTH), apply_rope(k_BTKH, cos_BTH, sin_BTH), v_BTKH

    def out(self, o_BTNH):
        return self.o_proj("BTNH,NHD->BTD", o_BTNH, self.config.dtype)


class LoraParam(nnx.Variable):
    """A LoRA adapter matrix (grpo_jax/models/lora.py): float32 and trained, while every `nnx.Param`
    (the base weights) stays frozen. A separate Variable type, so the base params and the
    adapters split into two pytrees (``abstract_params`` / ``abstract_adapters``)."""


def _lora_param(rngs, shape, axes) -> LoraParam:
    init = nnx.with_partitioning(nnx.initializers.zeros, axes)
    return LoraParam(init(rngs.params(), shape, jnp.float32), eager_sharding=False)


def _lora_args(config: config_lib.ModelConfig, name: str) -> dict:
    """The LoRA settings of projection `name`: rank 0 (none) unless it is a target."""
    rank = config.lora_rank if name in config.lora_targets else 0
    return {"lora_rank": rank, "lora_scale": config.lora_scale}


class Proj(nnx.Module):
    """A projection contracting the input's last axes with the kernel's first ones (the einsum
    `spec` documents which); the optional (zero-initialised) bias spans the output axes.

    The contraction runs as one 2-D matmul, [tokens, in] x [in, out], with the kernel and input
    reshaped (free: both are contiguous): XLA:CPU's dot for the 3- and 4-D einsums took 30 %
    longer in the forward and backward at training shapes. The matmul is `matmul.matmul` at the
    compute dtype (in bf16: float32 accumulation, XLA:CPU's bf16 kernels in the backward too).

    With `lora_rank` r > 0 the projection also holds LoRA adapters (Hu et al. 2021) A [*in, r]
    and B [r, *out] (`LoraParam`, logical axes those of the kernel's in / out axes, the rank axis
    replicated) and adds scale * (x @ A) @ B, as PEFT's Linear does, without merging them into
    the kernel. `num_in` is the kernel's number of input axes (2 for o_proj's [N, H, D]).
    """

    def __init__(
        self, rngs, init, shape, axes, param_dtype, *, bias: bool = False, num_in: int = 1,
        lora_rank: int = 0, lora_scale: float = 0.0,
    ):  # fmt: skip
        self.kernel = _param(rngs, init, shape, axes, param_dtype)
        self.use_bias = bias
        if bias:
            self.bias = _param(rngs, nnx.initializers.zeros, shape[1:], axes[1:], param_dtype)
        self.lora_rank, self.lora_scale = lora_rank, lora_scale
        if lora_rank:
            r = lora_rank
            self.lora_a = _lora_param(rngs, (*shape[:num_in], r), (*axes[:num_in], None))
            self.lora_b = _lora_param(rngs, (r, *shape[num_in:]), (None, *axes[num_in:]))

    def __call__(self, spec: str, x, dtype):
        inputs, out = spec.split("->")
        x_letters, k_letters = inputs.split(",")
        c = (len(x_letters) + len(k_letters) - len(out)) // 2  # contracted axes
        kernel = self.kernel[...]
        fan_in = math.prod(kernel.shape[:c])
        x_2d = x.astype(dtype).reshape(-1, fan_in)
        y = matmul_lib.matmul(x_2d, kernel.reshape(fan_in, -1), dtype)
        if self.lora_rank:  # base + adapter, unmerged: x @ W + scale * (x @ A) @ B
            a = self.lora_a[...].reshape(fan_in, self.lora_rank)
            b = self.lora_b[...].reshape(self.lora_rank, -1)
            y = y + matmul_lib.matmul(matmul_lib.matmul(x_2d, a, dtype), b, dtype) * self.lora_scale
        y = y.reshape(*x.shape[: x.ndim - c], *kernel.shape[c:])
        if self.use_bias:
            bias = self.bias[...].astype(dtype)
            y = y + bias.reshape((1,) * (y.ndim - bias.ndim) + bias.shape)
        return y


class MLP(nnx.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: config_lib.ModelConfig, *, rngs: nnx.Rngs):
        D, F, pdt = config.hidden_size, config.intermediate_size, config.param_dtype
        w_init = nnx.initializers.normal(config.initializer_range)
        lora = functools.partial(_lora_args, config)
        self.gate_proj = Proj(rngs, w_init, (D, F), ("embed", "mlp"), pdt, **lora("gate_proj"))
        self.up_proj = Proj(rngs, w_init, (D, F), ("embed", "mlp"), pdt, **lora("up_proj"))
        self.down_proj = Proj(rngs, w_init, (F, D), ("mlp", "embed"), pdt, **lora("down_proj"))
        self.dtype = config.dtype

    def __call__(self, x_BTD):
        dt = self.dtype
        h_BTF = jax.nn.silu(self.gate_proj("BTD,DF->BTF", x_BTD, dt))
        h_BTF = h_BTF * self.up_proj("BTD,DF->BTF", x_BTD, dt)
        h_BTF = nn.with_logical_constraint(h_BTF, ("batch", "seq", "act_mlp"))
        return self.down_proj("BTF,FD->BTD", h_BTF, dt)


class MoE(nnx.Module):
    """Qwen3-MoE's sparse block (grpo_jax/models/moe.py): a router [D, E] and E SwiGLU experts
    stacked on a leading ``expert`` axis, run as grouped matmuls."""

    def __init__(self, config: config_lib.ModelConfig, *, rngs: nnx.Rngs):
        c = config
        D, E, F, pdt = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.param_dtype
        w_init = nnx.initializers.normal(c.initializer_range)
        # The experts' model dimension is `expert_embed`, not `embed`: `expert` takes the
        # mesh axis `embed` would (sharding.LOGICAL_RULES), and one axis cannot split two dims.
        in_axes, out_axes = ("expert", "expert_embed", "mlp"), ("expert", "mlp", "expert_embed")
        for name, shape, axes in (
            ("router", (D, E), ("embed", None)),
            ("gate_proj", (E, D, F), in_axes),
            ("up_proj", (E, D, F), in_axes),
            ("down_proj", (E, F, D), out_axes),
        ):
            proj = nnx.Module()
            proj.kernel = _param(rngs, w_init, shape, axes, pdt)
            setattr(self, name, proj)
        self.config = config

    def __call__(self, x_BTD, valid_BT, experts_BTA=None):
        """(y_BTD, (experts_BTA, counts_E, probs_E, replayed, mismatched)): the block's output
        and its routing (``moe.layer_stats``).

        Args:
          valid_BT: 1 for the real tokens (the load statistics count those only).
          experts_BTA: optional experts to route to (router replay) instead of the top-A.
        """
        c, dt = self.config, self.config.dtype
        B, T, D = x_BTD.shape
        replay_XA = None if experts_BTA is None else experts_BTA.reshape(B * T, -1)
        y_XD, probs_XE, experts_XA, replayed_X = moe.sparse_ffn(
            x_BTD.reshape(B * T, D).astype(dt),
            *(p.kernel[...].astype(dt) for p in (self.router, self.gate_proj, self.up_proj,
                                                 self.down_proj)),
            num_experts_per_tok=c.num_experts_per_tok,
            norm_topk_prob=c.norm_topk_prob,
            experts_XA=replay_XA,
        )  # fmt: skip
        stats = moe.layer_stats(probs_XE, experts_XA, valid_BT.reshape(-1), replayed_X)
        return y_XD.reshape(B, T, D), (experts_XA.reshape(B, T, -1), *stats)


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + ffn(norm(x)).

    The feed-forward block (``mlp``) is part of the layer in dense models. In MoE models
    (``config.num_experts``) the layers hold attention and norms only, and ``Decoder`` adds the
    feed-forward stacks ``layers/mlp`` (the dense layers) and ``layers/moe`` (the MoE layers),
    each stacked over its own layers (``config.ffn_row``).
    """

    def __init__(self, config: config_lib.ModelConfig, *, rngs: nnx.Rngs):
        c = config
        kw = {"eps": c.rms_norm_eps, "dtype": c.dtype, "param_dtype": c.param_dtype, "rngs": rngs}
        self.input_norm = RMSNorm(c.hidden_size, "embed", **kw)
        self.attn = Attention(c, rngs=rngs)
        self.post_attn_norm = RMSNorm(c.hidden_size, "embed", **kw)
        if not c.num_experts:
            self.mlp = MLP(c, rngs=rngs)


def _stack(make, num: int, rngs: nnx.Rngs):
    """`num` modules `make(rngs)` stacked on a leading axis named None (never sharded)."""

    @nnx.split_rngs(splits=num)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def stacked(rngs):
        return make(rngs)

    return stacked(rngs)


def layer_runs(config: config_lib.ModelConfig) -> list[tuple[int, int, bool]]:
    """(start, stop, is_moe) of each run of consecutive layers of one kind, in order: each run is
    one ``lax.scan`` (a dense model is one run)."""
    runs: list[tuple[int, int, bool]] = []
    for i, is_moe in enumerate(config.moe_layers):
        if runs and runs[-1][2] == is_moe:
            runs[-1] = (runs[-1][0], i + 1, is_moe)
        else:
            runs.append((i, i + 1, is_moe))
    return runs


class Decoder(nnx.Module):
    """Embedding, L stacked decoder layers (scanned) and the final norm / unembedding."""

    def __init__(self, config: config_lib.ModelConfig, *, rngs: nnx.Rngs):
        c = config
        self.embed = nnx.Module()
        self.embed.embedding = _param(
            rngs,
            nnx.initializers.normal(c.initializer_range),
            (c.vocab_size, c.hidden_size),
            ("vocab", "embed"),
            c.param_dtype,
        )

        # The stacked layer axis gets the logical name None (replicated, never sharded).
        self.layers = _stack(lambda r: DecoderLayer(c, rngs=r), c.num_layers, rngs)
        if c.num_experts:
            num_moe = c.num_moe_layers
            if num_moe < c.num_layers:
                self.layers.mlp = _stack(lambda r: MLP(c, rngs=r), c.num_layers - num_moe, rngs)
            if num_moe:
                self.layers.moe = _stack(lambda r: MoE(c, rngs=r), num_moe, rngs)
        kw = {"eps": c.rms_norm_eps, "dtype": c.dtype, "param_dtype": c.param_dtype, "rngs": rngs}
        self.final_norm = RMSNorm(c.hidden_size, "embed", **kw)
        if not c.tie_word_embeddings:
            self.lm_head = nnx.Module()
            self.lm_head.kernel = _param(
                rngs,
                nnx.initializers.normal(c.initializer_range),
                (c.hidden_size, c.vocab_size),
                ("embed", "vocab"),
                c.param_dtype,
            )
        self.config = config

    def __call__(self, ids_BT, positions_BT, mask, kv=None, index=None):
        """Final-normed hidden states [B,T,D], and the updated (k_LBKHS, v_LBKSH) with a cache.

        ``run`` with the router statistics of MoE layers dropped (see there for the arguments).
        """
        h_BTD, kv, _ = self.run(ids_BT, positions_BT, mask, kv, index)
        return h_BTD, kv

    def run(self, ids_BT, positions_BT, mask, kv=None, index=None, routing_LmBTA=None):
        """``__call__`` and what the MoE layers' routers did (``moe.RouterStats``).

        Args:
          ids_BT: token ids.
          positions_BT: rotary position of each token.
          mask: without a cache, the rows' `attention.Mask` (causal self-attention through
            `attention.self_attention` and `config.attention_impl`); with one, bool
            [B, T, S]: query t may attend to cache slot s, or an `attention.Mask` when the T
            tokens are all the cache holds (a prefill from slot 0 of a cache of T slots): the
            keys are then the tokens' own, and the attention is `self_attention`'s.
          kv: optional (k_LBKHS, v_LBKSH) cache; the new keys/values are written at slots
            [index, index + T) before attending.
          index: int32 scalar write slot (with kv).
          routing_LmBTA: optional experts per MoE layer and token to route to (router replay)
            instead of the routers' own top-A.

        Returns:
          (h_BTD, kv, moe.RouterStats); the stats have Lm = 0 layers in a dense model, and
          count every token as real when ``mask`` is a cache mask.
        """
        c = self.config
        x_BTD = jnp.take(self.embed.embedding[...], ids_BT, axis=0).astype(c.dtype)
        x_BTD = nn.with_logical_constraint(x_BTD, ("batch", "seq", "act_embed"))
        cos_BTH, sin_BTH = rope_tables(c, positions_BT)
        # Each layer's attention state, and its row of its feed-forward stack (config.ffn_row).
        layer_def, mlp_state, moe_state, attn_state = nnx.split(
            self.layers, nnx.PathContains("mlp"), nnx.PathContains("moe"), ...
        )
        # Self-attention over the T tokens: training, log-probs, and a prefill of a whole cache.
        self_attend = isinstance(mask, attention.Mask)
        valid_BT = mask.segments_BT > 0 if self_attend else jnp.ones(ids_BT.shape, bool)

        def body(carry, xs, *, is_moe: bool, idle):
            x_BTD, kv = carry
            state, ffn, layer_idx, replay_BTA = xs
            # The other feed-forward stack's first row completes the module graph, unused.
            mlp, moe_ = (idle, ffn) if is_moe else (ffn, idle)
            layer = nnx.merge(layer_def, mlp, moe_, state)
            q_BTNH, k_BTKH, v_BTKH = layer.attn.qkv(layer.input_norm(x_BTD), cos_BTH, sin_BTH)
            q_BTNH = nn.with_logical_constraint(q_BTNH, ("batch", "seq", "act_heads", None))
            if self_attend:
                q_, k_, v_ = ulysses_in(c, q_BTNH, k_BTKH.astype(c.dtype), v_BTKH.astype(c.dtype))
                o_BTNH = attention.self_attention(q_, k_, v_, mask, c.attention_impl)
                o_BTNH = ulysses_out(o_BTNH)
            if kv is not None:
                # Keys are kept transposed, [.., H, S]: the scores then read each key block
                # with the slot axis contiguous, 3x faster on XLA:CPU than [.., S, H] at decode.
                k_BKHT, v_BKTH = k_BTKH.transpose(0, 2, 3, 1), v_BTKH.transpose(0, 2, 1, 3)
                # The whole stack stays in the scan carry: inside the sampler's while_loop XLA
                # updates it in place, whereas per-layer xs/ys slices copied it every step.
                k_LBKHS, v_LBKSH = kv
                k_LBKHS = jax.lax.dynamic_update_slice(
                    k_LBKHS, k_BKHT[None].astype(k_LBKHS.dtype), (layer_idx, 0, 0, 0, index)
                )
                v_LBKSH = jax.lax.dynamic_update_slice(
                    v_LBKSH, v_BKTH[None].astype(v_LBKSH.dtype), (layer_idx, 0, 0, index, 0)
                )
                kv = (k_LBKHS, v_LBKSH)
                if not self_attend:
                    k_BKHS, v_BKSH = k_LBKHS[layer_idx], v_LBKSH[layer_idx]
                    o_BTNH = attention.attend(
                        q_BTNH, k_BKHS.astype(c.dtype), v_BKSH.astype(c.dtype), mask
                    )
            o_BTD = nn.with_logical_constraint(
                layer.attn.out(o_BTNH), ("batch", "seq", "act_embed")
            )
            x_BTD = x_BTD + o_BTD
            h_BTD = layer.post_attn_norm(x_BTD)
            if not is_moe:
                return (x_BTD + layer.mlp(h_BTD), kv), None
            y_BTD, routed = layer.moe(h_BTD, valid_BT, replay_BTA)
            return (x_BTD + y_BTD, kv), routed

        routed = []
        for start, stop, is_moe in layer_runs(c):
            row = c.ffn_row(start)
            stack, other = (moe_state, mlp_state) if is_moe else (mlp_state, moe_state)
            rows = slice(row, row + stop - start)
            replay = None if routing_LmBTA is None or not is_moe else routing_LmBTA[rows]
            xs = (
                jax.tree.map(lambda a: a[start:stop], attn_state),
                jax.tree.map(lambda a: a[rows], stack),
                jnp.arange(start, stop, dtype=jnp.int32),
                replay,
            )
            run_body = functools.partial(
                body, is_moe=is_moe, idle=jax.tree.map(lambda a: a[0], other)
            )
            if c.remat:
                run_body = jax.checkpoint(run_body, policy=remat_policy_fn(c))
            (x_BTD, kv), ys = jax.lax.scan(run_body, (x_BTD, kv), xs)
            if is_moe:
                routed.append(ys)
        B, T = ids_BT.shape
        A, E = c.num_experts_per_tok, c.num_experts
        if routed:
            experts, counts, probs, replayed, mismatched = (
                jnp.concatenate(p) for p in zip(*routed)
            )
        else:
            experts = jnp.zeros((0, B, T, A), jnp.int32)
            counts = probs = jnp.zeros((0, E), jnp.float32)
            replayed = mismatched = jnp.zeros((0,), jnp.float32)
        tokens = jnp.sum(valid_BT.astype(jnp.float32))
        stats = moe.RouterStats(experts, counts, probs, tokens, replayed, mismatched)
        return self.final_norm(x_BTD), kv, stats

    def unembed(self, h_xD):
        c = self.config
        if c.tie_word_embeddings:
            w_VD = self.embed.embedding[...].astype(c.dtype)
            logits_xV = jnp.einsum(
                "...D,VD->...V", h_xD.astype(c.dtype), w_VD, preferred_element_type=jnp.float32
            )
        else:
            w_DV = self.lm_head.kernel[...].astype(c.dtype)
            logits_xV = jnp.einsum(
                "...D,DV->...V", h_xD.astype(c.dtype), w_DV, preferred_element_type=jnp.float32
            )
        if logits_xV.ndim == 3:
            logits_xV = nn.with_logical_constraint(logits_xV, ("batch", "seq", "act_vocab"))
        return logits_xV


def sequence_shards(name: str = "seq") -> int:
    """Over how many devices the active logical-axis rules split logical axis `name` on the
    active mesh (1 without either): with "seq", Ulysses sequence parallelism is on when it is
    above 1 (grpo_jax/sharding.py; the sampler's rules keep "seq" whole)."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = dict(nn.get_logical_axis_rules()).get(name)
    if mesh.empty or axes is None:
        return 1
    axes = (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in axes if a in mesh.axis_names)


def ulysses_in(config: config_lib.ModelConfig, q_BTNH, k_BTKH, v_BTKH):
    """Queries, keys and values as whole rows split by head (Ulysses, DeepSpeed's and verl's
    sequence parallelism): under a ``sequence`` mesh axis the activations arrive split by
    token, and these constraints make GSPMD turn that into a split by head (an all-to-all), so
    each device attends whole rows for its heads with any attention implementation. The kv
    heads are split the same way where they divide (GQA groups stay on one device), else every
    device gets all of them (verl repeats them). Without the axis: unchanged."""
    sp = sequence_shards()
    if sp == 1:
        return q_BTNH, k_BTKH, v_BTKH
    q_BTNH = nn.with_logical_constraint(q_BTNH, ("batch", "attn_seq", "attn_heads", None))
    split_kv = config.num_kv_heads % sequence_shards("attn_kv_heads") == 0
    kv_axes = ("batch", "attn_seq", "attn_kv_heads" if split_kv else None, None)
    return (
        q_BTNH,
        nn.with_logical_constraint(k_BTKH, kv_axes),
        nn.with_logical_constraint(v_BTKH, kv_axes),
    )


def ulysses_out(o_BTNH):
    """Attention's output back to the token split (the all-to-all the other way)."""
    if sequence_shards() == 1:
        return o_BTNH
    o_BTNH = nn.with_logical_constraint(o_BTNH, ("batch", "attn_seq", "attn_heads", None))
    return nn.with_logical_constraint(o_BTNH, ("batch", "seq", "act_heads", None))


def remat_policy_fn(config: config_lib.ModelConfig):
    """The ``jax.checkpoint`` policy of ``config.remat_policy``.

    "dots_except_mlp_in_saveable" keeps what "dots_with_no_batch_dims_saveable" keeps except
    the MLP's input projections (gate and up, the matmuls whose kernel is [D, F]), the largest
    outputs: SmolLM2 saves 2,112 instead of 5,184 floats per token and layer, and its backward
    recomputes 2 of the layer's 7 matmuls. SmolLM2, a 4,096-token packed micro-batch: XLA's
    temporaries 3.3 -> 1.9 GiB (plan.py).

    The low-precision projections (`matmul.matmul` in bf16) are custom VJPs whose dots no policy
    sees; their outputs are named ``lowp_dot:KxN`` and count here as the 2-D dot (no batch dims)
    with a [K, N] kernel they stand for: saved by the dots policies, the MLP's input projections
    not by "dots_except_mlp_in_saveable", none by "nothing_saveable".
    """
    if config.remat_policy == "nothing_saveable":
        return jax.checkpoint_policies.nothing_saveable
    if config.remat_policy == "dots_except_mlp_in_saveable":
        base = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        skip = {(config.hidden_size, config.intermediate_size)}  # the MLP's gate and up kernels
    else:
        base, skip = getattr(jax.checkpoint_policies, config.remat_policy), set()

    def policy(prim, *avals, **params):
        if str(prim) == "name":
            kernel = matmul_lib.weight_shape(params["name"])
            return kernel is not None and kernel not in skip
        if prim is jax.lax.dot_general_p and len(avals) == 2 and avals[1].shape in skip:
            return False
        return base(prim, *avals, **params)

    return policy


def _rotate_half(x):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x_BTnH, cos_BTH, sin_BTH):
    """HF apply_rotary_pos_emb on one of q [B,T,N,H] / k [B,T,K,H] (tables cast to x's dtype)."""
    cos_BT1H = cos_BTH[:, :, None, :].astype(x_BTnH.dtype)
    sin_BT1H = sin_BTH[:, :, None, :].astype(x_BTnH.dtype)
    return x_BTnH * cos_BT1H + _rotate_half(x_BTnH) * sin_BT1H


def rope_inv_freq(config: config_lib.ModelConfig) -> np.ndarray:
    """Rotary inverse frequencies [H/2] (float32), with HF's "linear" / "llama3" scaling."""
    H = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (np.arange(0, H, 2, dtype=np.int64).astype(np.float32) / H)
    )
    inv_freq = inv_freq.astype(np.float32)
    rope = config.rope_scaling_dict
    rope_type = rope.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / np.float32(rope["factor"])
    elif rope_type == "llama3":
        # transformers _compute_llama3_parameters: keep high frequencies, divide low frequencies
        # by `factor`, and interpolate smoothly in between.
        factor = rope["factor"]
        low_freq_factor = rope["low_freq_factor"]
        high_freq_factor = rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def rope_tables(config: config_lib.ModelConfig, positions_BT):
    """cos/sin [B,T,H] in float32 (HF layout: the H/2 frequencies repeated twice)."""
    inv_freq = jnp.asarray(rope_inv_freq(config))
    freqs_BTh = positions_BT.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
    emb_BTH = jnp.concatenate([freqs_BTh, freqs_BTh], axis=-1)
    return jnp.cos(emb_BTH), jnp.sin(emb_BTH)


@functools.lru_cache(maxsize=64)
def _skeleton(config: config_lib.ModelConfig):
    """(graphdef, abstract Param state[, abstract LoraParam state]) of the module tree, built
    once per config; the third entry only when config.lora_rank > 0."""
    abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    if config.lora_rank:
        return nnx.split(abstract, nnx.Param, LoraParam)
    return nnx.split(abstract, nnx.Param)[:2]


def _base_config(config: config_lib.ModelConfig) -> config_lib.ModelConfig:
    """`config` without adapters: the module tree of the base params."""
    return dataclasses.replace(config, lora_rank=0, lora_targets=()) if config.lora_rank else config


def decoder(config: config_lib.ModelConfig, params) -> Decoder:
    """The Decoder module holding `params` (called inside a trace; checks the structure).

    With LoRA adapters under ``params["lora"]`` (grpo_jax/models/lora.py) the targeted projections
    apply them unmerged; without them the module is the base model (adapters disabled).
    """
    adapters = params.get(config_lib.ADAPTERS) if isinstance(params, Mapping) else None
    if adapters is None:
        graphdef, abstract_state = _skeleton(_base_config(config))
        check_params(config, params)
        state = jax.tree.map(lambda x: x, abstract_state)  # Fresh Variables; the cache stays clean.
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)
    if not config.lora_rank:
        raise ValueError(
            f"params carry LoRA adapters (params[{config_lib.ADAPTERS!r}]) but "
            "ModelConfig.lora_rank=0"
        )
    base = {k: v for k, v in params.items() if k != config_lib.ADAPTERS}
    check_params(config, base)
    check_adapters(config, adapters)
    graphdef, abstract_state, abstract_lora = _skeleton(config)
    state, lora_state = jax.tree.map(lambda x: x, (abstract_state, abstract_lora))
    nnx.replace_by_pure_dict(state, base)
    nnx.replace_by_pure_dict(lora_state, adapters)
    return nnx.merge(graphdef, state, lora_state)


def check_params(config: config_lib.ModelConfig, params) -> None:
    """Raises ValueError naming the first missing, unexpected or mis-shaped base param."""
    _check_tree("param", abstract_params(config), params, config)


def check_adapters(config: config_lib.ModelConfig, adapters) -> None:
    """Raises ValueError unless `adapters` has the structure and shapes of abstract_adapters."""
    _check_tree("LoRA adapter", abstract_adapters(config), adapters, config)


def _check_tree(what: str, expected, got_tree, config: config_lib.ModelConfig) -> None:
    want = dict(flatten_params(expected))
    got = dict(flatten_params(got_tree))
    if want.keys() != got.keys():
        missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
        noun = "params" if what == "param" else f"{what}s"
        raise ValueError(
            f"{noun} do not match arch={config.arch!r}: missing {missing}, unexpected {extra}"
        )
    for name, spec in want.items():
        if tuple(got[name].shape) != tuple(spec.shape):
            raise ValueError(
                f"{what} {name!r} has shape {tuple(got[name].shape)}, expected "
                f"{tuple(spec.shape)} for arch={config.arch!r}"
            )


def flatten_params(tree, prefix: str = ""):
    for key in sorted(tree):
        value = tree[key]
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            yield from flatten_params(value, name)
        else:
            yield name, value


def init_params(config: config_lib.ModelConfig, rng) -> dict:
    """Random parameters (normal(initializer_range) weights, zero biases, unit norms).

    Returns:
      Nested dict of arrays in ``config.param_dtype`` (structure in the module docstring).
    """
    return _init_params(config, rng)


@functools.partial(jax.jit, static_argnums=0)
def _init_params(config: config_lib.ModelConfig, rng) -> dict:
    # One normal draw sliced into every weight: a single threefry call compiles in about a second,
    # where one draw per (vmapped) parameter took over 10 s to compile on a 2-core CPU.
    shapes = dict(flatten_params(abstract_params(config)))
    sizes = {name: math.prod(s.shape) for name, s in shapes.items() if _init_kind(name) == "normal"}
    noise = jax.random.normal(rng, (sum(sizes.values()),), jnp.float32) * config.initializer_range
    flat, offset = {}, 0
    for name, spec in shapes.items():
        match _init_kind(name):
            case "normal":
                value = noise[offset : offset + sizes[name]].reshape(spec.shape)
                offset += sizes[name]
            case "zeros":
                value = jnp.zeros(spec.shape)
            case "ones":
                value = jnp.ones(spec.shape)
        flat[name] = value.astype(spec.dtype)
    return unflatten_params(flat)


def _init_kind(name: str) -> str:
    """Initialiser of a flat param name: unit norm scales, zero biases, normal weights."""
    if name.endswith("/scale"):
        return "ones"
    if name.endswith("/bias"):
        return "zeros"
    return "normal"


def unflatten_params(flat: Mapping[str, Any]) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def abstract_params(config: config_lib.ModelConfig) -> dict:
    """Shapes and dtypes of the params (jax.ShapeDtypeStruct leaves), without allocating."""
    return _abstract_params(config)


@functools.lru_cache(maxsize=64)
def _abstract_params(config: config_lib.ModelConfig) -> dict:
    _, abstract_state = _skeleton(_base_config(config))
    return nnx.to_pure_dict(abstract_state)


def logical_axes(config: config_lib.ModelConfig) -> dict:
    """PartitionSpecs of logical axis names, same structure as the params."""
    _, abstract_state = _skeleton(_base_config(config))
    return nnx.to_pure_dict(nnx.get_partition_spec(abstract_state))


def _lora_skeleton(config: config_lib.ModelConfig):
    if not config.lora_rank:
        raise ValueError("ModelConfig.lora_rank=0: this model has no LoRA adapters")
    return _skeleton(config)[2]


def abstract_adapters(config: config_lib.ModelConfig) -> dict:
    """Shapes of the LoRA adapters (float32 ShapeDtypeStructs), per target projection::

        layers/attn/q_proj/lora_a   [L, D, r]       (None, embed, None)
        layers/attn/q_proj/lora_b   [L, r, N, H]    (None, None, heads, head_dim)
        layers/attn/o_proj/lora_a   [L, N, H, r]    (None, heads, head_dim, None)
        layers/mlp/down_proj/lora_b [L, r, D]       (None, None, embed)   ...

    Raises:
      ValueError: config.lora_rank is 0.
    """
    return nnx.to_pure_dict(_lora_skeleton(config))


def adapter_logical_axes(config: config_lib.ModelConfig) -> dict:
    """PartitionSpecs of logical axis names of the LoRA adapters (``abstract_adapters``)."""
    return nnx.to_pure_dict(nnx.get_partition_spec(_lora_skeleton(config)))


def check_inputs(input_ids, attention_mask):
    if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids must be [B,T] and attention_mask the same shape; got "
            f"input_ids{tuple(input_ids.shape)}, attention_mask{tuple(attention_mask.shape)}"
        )


def position_ids(attention_mask_BT):
    """Position ids cumsum(mask) - 1 (0 on left padding, which is masked out anyway)."""
    return jnp.maximum(jnp.cumsum(attention_mask_BT.astype(jnp.int32), axis=1) - 1, 0)


@functools.partial(jax.jit, static_argnums=0)
def hidden_states(config: config_lib.ModelConfig, params, input_ids, attention_mask):
    """Final-normed hidden states h_BTD in config.dtype (``forward == unembed(hidden_states)``).

    Args:
      input_ids: [B,T] int token ids; ids under mask 0 are ignored.
      attention_mask: [B,T], 1 for real tokens and 0 for padding (left or right).
    """
    check_inputs(input_ids, attention_mask)
    mask = attention.Mask.padded(attention_mask)
    h_BTD, _ = decoder(config, params)(input_ids, position_ids(attention_mask), mask)
    return h_BTD


@functools.partial(jax.jit, static_argnums=0)
def hidden_states_and_routing(
    config: config_lib.ModelConfig, params, input_ids, attention_mask, routing_LmBTA=None
):
    """``hidden_states`` and what the MoE layers' routers did (``moe.RouterStats``: the chosen
    experts, per-expert loads and probabilities over the real tokens; the auxiliary loss is
    ``moe.load_balancing_loss`` of them).

    Args:
      routing_LmBTA: optional int experts per MoE layer and token (router replay, e.g. the
        rollout's ``RouterStats.experts_LmBTA``) to route to instead of the routers' top-A.
    """
    check_inputs(input_ids, attention_mask)
    mask = attention.Mask.padded(attention_mask)
    h_BTD, _, stats = decoder(config, params).run(
        input_ids, position_ids(attention_mask), mask, routing_LmBTA=routing_LmBTA
    )
    return h_BTD, stats


@functools.partial(jax.jit, static_argnums=0)
def hidden_states_packed(
    config: config_lib.ModelConfig, params, tokens_RL, positions_RL, segments_RL, prefixes_RL=None
):
    """Hidden states of rows that pack several sequences each (grpo_jax/trainer/packing.py).

    A token attends to the earlier tokens of its own segment and of its prefix segment (the
    prompt a response continues), never to another segment, and padding (segment 0) is seen by
    nobody: each sequence gets exactly the hidden states it would get alone, with its prompt
    shared by the responses of its group.

    Args:
      tokens_RL: [R, L] int token ids.
      positions_RL: [R, L] int rotary positions (0.. within each sequence).
      segments_RL: [R, L] int, 1.. per segment of a row, 0 on padding.
      prefixes_RL: [R, L] int, the segment each token continues (a prompt's for its responses,
        the token's own otherwise); None = each segment is a whole sequence.

    Returns:
      h_RLD in config.dtype.
    """
    check_inputs(tokens_RL, segments_RL)
    mask = attention.Mask.packed(segments_RL, prefixes_RL)
    h_RLD, _ = decoder(config, params)(tokens_RL, positions_RL.astype(jnp.int32), mask)
    return h_RLD


@functools.partial(jax.jit, static_argnums=0)
def hidden_states_packed_and_routing(
    config: config_lib.ModelConfig, params, tokens_RL, positions_RL, segments_RL,
    prefixes_RL=None, routing_LmRLA=None,
):  # fmt: skip
    """``hidden_states_packed`` and what the MoE layers' routers did (``moe.RouterStats`` over
    the packed tokens, padding excluded); ``routing_LmRLA``: optional experts per MoE layer and
    packed position to route to (router replay), ``moe.no_route`` where none was recorded."""
    check_inputs(tokens_RL, segments_RL)
    mask = attention.Mask.packed(segments_RL, prefixes_RL)
    h_RLD, _, stats = decoder(config, params).run(
        tokens_RL, positions_RL.astype(jnp.int32), mask, routing_LmBTA=routing_LmRLA
    )
    return h_RLD, stats


@functools.partial(jax.jit, static_argnums=0)
def unembed(config: config_lib.ModelConfig, params, h_xD):
    """Logits [..., V] in float32 from hidden states [..., D] (tied or untied head)."""
    return decoder(config, params).unembed(h_xD)


@functools.partial(jax.jit, static_argnums=0)
def forward(config: config_lib.ModelConfig, params, input_ids, attention_mask):
    """Logits [B,T,V] float32 of every position (see ``hidden_states`` for the arguments)."""
    return unembed(config, params, hidden_states(config, params, input_ids, attention_mask))
