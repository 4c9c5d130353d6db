"""Incremental decoding: KV caches, `prefill` and `decode_step`.

`KVCache` holds every row's keys and values ([L, B, ...], the prefill's and chunked prefill's
form); `GroupKVCache` is the sampler's decode-loop form (each prompt stored once per GRPO group,
responses in blocks read only once written) and `DecodeParams` the per-layer weights that loop
reads in place. `prefill` and `decode_step` give the logits of `transformer.forward` at the same
positions, up to float rounding (tests/test_model.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax
import jax
import jax.numpy as jnp
from flax import linen as nn

from grpo_jax.models import attention, moe, transformer
from grpo_jax.models import config as config_lib


@flax.struct.dataclass
class KVCache:
    """Per-layer keys and values for incremental decoding (a pytree, passed in and returned).

    Attributes:
      k_LBKHS: keys [L,B,K,H,S] in the cache dtype, rotary-embedded, transposed (``_attend``
        reads directly, so a decode step never transposes the cache).
      v_LBKSH: values [L,B,K,S,H].
      mask_BS: int32 [B,S], 1 where slot s holds a real token of row b.
      pos_B: int32 [B], the position id the next token of row b gets.
      index: int32 scalar, the next slot to write (shared by all rows).
    """

    k_LBKHS: jax.Array
    v_LBKSH: jax.Array
    mask_BS: jax.Array
    pos_B: jax.Array
    index: jax.Array


@flax.struct.dataclass
class GroupKVCache:
    """The decode loop's cache for GRPO groups: each prompt once, each response in blocks.

    Why: the n samples of a prompt share its keys and values, so a cache of P * n full rows
    reads every prompt n times per decode step; and a cache sized for the longest response
    reads its unwritten slots too. Here each prompt's keys and values are stored once ([P, ...],
    the prefill's) and attended by all n rows of its group in one product with n * R query rows
    per kv head; each row's response keys and values live in NB blocks of C slots, and a step
    reads only the blocks written so far (``lax.switch`` on ``index // C``). SmolLM2-135M, 8
    GSM8K prompts x 4 x 256 tokens: the attention reads 1,536 prompt + on average 4,600
    response slot-rows per layer and step instead of 32 x 447 = 14,304.

    Every array is its own buffer (one per layer and block), so a decode loop reads and updates
    them in place: slices of a stacked cache are copied by XLA:CPU before a product reads them
    (the whole cache once more per step).

    Rows (B here, the sampler's slots) are a subset of the P * n rollout rows, in any order:
    ``row_B`` names each one's rollout row (group-major, so its prompt is ``row_B // n``), which
    lets a sampler drop finished rows (``take_rows``) while the prompts stay where they are.

    Attributes:
      prompt_k_PKHT: L arrays [P,K,H,T], the prompts' rotary-embedded keys (transposed, as
        ``KVCache``).
      prompt_v_PKTH: L arrays [P,K,T,H].
      prompt_mask_PT: int32 [P,T], 1 on real prompt tokens (prompts are left-padded).
      k_BKHC: L tuples of NB arrays [B,K,H,C]: response slot j of row b is block j // C,
        column j % C.
      v_BKCH: L tuples of NB arrays [B,K,C,H].
      row_B: int32 [B], the rollout row each cache row decodes (prompt row_B // n).
      pos_B: int32 [B], the position id the next token of row b gets.
      index: int32 scalar, the response slots written so far (shared by all rows).
      n: static, the rows per prompt of the rollout (GRPO's group size).
    """

    prompt_k_PKHT: tuple[jax.Array, ...]
    prompt_v_PKTH: tuple[jax.Array, ...]
    prompt_mask_PT: jax.Array
    k_BKHC: tuple[tuple[jax.Array, ...], ...]
    v_BKCH: tuple[tuple[jax.Array, ...], ...]
    row_B: jax.Array
    pos_B: jax.Array
    index: jax.Array
    n: int = flax.struct.field(pytree_node=False)


MAX_DECODE_BLOCKS = 8  # response blocks of a GroupKVCache: bounds the branches each layer compiles


DECODE_BLOCK = 64  # response slots per block, until MAX_DECODE_BLOCKS would be exceeded


def decode_blocks(response_slots: int) -> tuple[int, int]:
    """(NB, C): the blocks and block length of a ``GroupKVCache`` holding ``response_slots``.

    Rule: blocks of DECODE_BLOCK slots, at most MAX_DECODE_BLOCKS of them (longer responses get
    longer blocks), the slots split evenly: 255 -> (4, 64), 1023 -> (8, 128), 47 -> (1, 47).
    A step reads ceil(written / C) blocks, so at most C - 1 unwritten slots per row.
    """
    slots = max(int(response_slots), 1)
    num_blocks = min(MAX_DECODE_BLOCKS, -(-slots // DECODE_BLOCK))
    return num_blocks, -(-slots // num_blocks)


def group_cache(cache: KVCache, *, n: int, response_slots: int) -> GroupKVCache:
    """The ``GroupKVCache`` of P prefilled prompts, for n rows each (adjacent), empty responses.

    Args:
      cache: the prefill's ``KVCache`` of the P prompts, every slot written (index == S).
      n: rows per prompt.
      response_slots: the response tokens the rows will feed back (the sampler's
        max_new_tokens - 1: the last drawn token is never fed).

    Returns:
      A cache of P * n rows, row b decoding prompt b // n.
    """
    num_layers, P, K, H, _ = cache.k_LBKHS.shape
    num_blocks, C = decode_blocks(response_slots)
    B, dtype = P * n, cache.k_LBKHS.dtype
    return GroupKVCache(
        prompt_k_PKHT=tuple(cache.k_LBKHS[i] for i in range(num_layers)),
        prompt_v_PKTH=tuple(cache.v_LBKSH[i] for i in range(num_layers)),
        prompt_mask_PT=cache.mask_BS,
        k_BKHC=tuple(
            tuple(jnp.zeros((B, K, H, C), dtype) for _ in range(num_blocks))
            for _ in range(num_layers)
        ),
        v_BKCH=tuple(
            tuple(jnp.zeros((B, K, C, H), dtype) for _ in range(num_blocks))
            for _ in range(num_layers)
        ),
        row_B=jnp.arange(B, dtype=jnp.int32),
        pos_B=jnp.repeat(cache.pos_B, n, axis=0),
        index=jnp.zeros((), jnp.int32),
        n=n,
    )


def take_rows(cache: GroupKVCache, keep_B: jax.Array) -> GroupKVCache:
    """The cache of rows ``keep_B`` only (a gather of the response blocks; prompts stay).

    It must drop rows: a cache of all P * n rows is taken to hold them in order (the prompt
    attention then skips its scatter), which a permutation of all of them would break.
    """
    total = cache.prompt_mask_PT.shape[0] * cache.n
    if keep_B.shape[0] >= total:
        raise ValueError(f"take_rows keeps {keep_B.shape[0]} of {total} rows; it must drop some")
    return dataclasses.replace(
        cache,
        k_BKHC=tuple(tuple(jnp.take(k, keep_B, axis=0) for k in ks) for ks in cache.k_BKHC),
        v_BKCH=tuple(tuple(jnp.take(v, keep_B, axis=0) for v in vs) for vs in cache.v_BKCH),
        row_B=cache.row_B[keep_B],
        pos_B=cache.pos_B[keep_B],
    )


def cache_dtype(config: config_lib.ModelConfig, backend: str | None = None) -> jnp.dtype:
    """The dtype the KV cache stores (``config.kv_cache_dtype``) on `backend` (default: JAX's
    default backend); the decode attention computes in the wider of it and the compute dtype.

    "auto" is the compute dtype, except float32 for a bfloat16 model on XLA:CPU: there the
    attention's batched bf16 x bf16 -> float32 dots over the cache cost more per cached token
    than float32 ones (SmolLM2, 32 rows over 320 prompt columns + 256 tokens, on an
    AVX512-BF16 EPYC: 140.5-147.7 ms a decode step against 101.0-110.5 with a float32 cache,
    `benchmarks/bench_kv_cache.py`; docs/performance.md).
    The keys and values are computed in bf16 either way; into a float32 cache XLA may store
    them without their last rounding to bf16 (its excess precision), and the attention's
    arithmetic is float32 (its probabilities are not rounded to bf16 before the value
    product): the logits differ within bf16 rounding. The planner resolves "auto" for the
    backend it plans.
    """
    if config.kv_cache_dtype != "auto":
        return jnp.dtype(config.kv_cache_dtype)
    backend = jax.default_backend() if backend is None else backend
    if backend == "cpu" and jnp.dtype(config.dtype) == jnp.bfloat16:
        return jnp.dtype(jnp.float32)
    return jnp.dtype(config.dtype)


def attention_dtype(config: config_lib.ModelConfig, kv_dtype) -> jnp.dtype:
    """The dtype a decode attention over a cache (or pool) of `kv_dtype` computes in: the wider
    of it and the compute dtype."""
    return jnp.promote_types(config.dtype, kv_dtype)


def init_cache(
    config: config_lib.ModelConfig, batch_size: int, max_len: int, *, dtype=None
) -> KVCache:
    """An empty cache of ``max_len`` slots (dtype defaults to ``cache_dtype(config)``)."""
    dtype = cache_dtype(config) if dtype is None else dtype
    shape = (config.num_layers, batch_size, config.num_kv_heads, max_len, config.head_dim)
    return KVCache(
        k_LBKHS=jnp.zeros((*shape[:3], shape[4], shape[3]), dtype),
        v_LBKSH=jnp.zeros(shape, dtype),
        mask_BS=jnp.zeros((batch_size, max_len), jnp.int32),
        pos_B=jnp.zeros((batch_size,), jnp.int32),
        index=jnp.zeros((), jnp.int32),
    )


@functools.partial(jax.jit, static_argnums=0)
def prefill(
    config: config_lib.ModelConfig, params, input_ids_BT, attention_mask_BT, cache: KVCache
):
    """Runs T tokens through the model, writing slots [index, index + T) of the cache
    (``prefill_and_routing`` without the routing).

    Returns:
      (logits_BV float32 at the last column, updated cache).
    """
    logits_BV, cache, _ = prefill_and_routing(
        config, params, input_ids_BT, attention_mask_BT, cache
    )
    return logits_BV, cache


@functools.partial(jax.jit, static_argnums=0)
def prefill_and_routing(
    config: config_lib.ModelConfig, params, input_ids_BT, attention_mask_BT, cache: KVCache
):
    """Runs T tokens through the model, writing slots [index, index + T) of the cache.

    The input is left-padded, so column T-1 is each row's last real token. Positions continue from
    ``cache.pos_B`` (cumsum of the mask), so prefilling in chunks equals one prefill. The caller
    keeps ``index + T <= S``: the write is a ``dynamic_update_slice``, which clamps rather than
    raising when it would run past the end.

    When T == S (the sampler's prefill of a fresh cache of the prompts' width: index is then 0)
    the tokens attend to themselves through `attention.self_attention`, so
    `config.attention_impl` applies (blockwise, cuDNN or splash: memory linear in the prompt);
    a chunk into a partly filled cache attends to the cache (`attention.attend`).

    Returns:
      (logits_BV float32 at the last column, updated cache, experts_LmBTA int32: the experts
      each token was routed to in each MoE layer, Lm = 0 for a dense model).
    """
    transformer.check_inputs(input_ids_BT, attention_mask_BT)
    T, S = input_ids_BT.shape[1], cache.mask_BS.shape[1]
    if T > S:
        raise ValueError(f"prefill of T={T} tokens does not fit a KV cache of S={S} slots")
    if (
        cache.k_LBKHS.shape[0] != config.num_layers
        or cache.mask_BS.shape[0] != input_ids_BT.shape[0]
    ):
        raise ValueError(
            f"KV cache k_LBKHS{tuple(cache.k_LBKHS.shape)} does not match L={config.num_layers}, "
            f"B={input_ids_BT.shape[0]}"
        )
    mask_BT = attention_mask_BT.astype(jnp.int32)
    positions_BT = cache.pos_B[:, None] + transformer.position_ids(mask_BT)
    mask_BS = jax.lax.dynamic_update_slice(cache.mask_BS, mask_BT, (0, cache.index))
    query_slot_T = cache.index + jnp.arange(T, dtype=jnp.int32)
    key_slot_S = jnp.arange(S, dtype=jnp.int32)
    if T == S:  # the whole cache: index is 0, the keys are the tokens' own
        mask = attention.Mask.padded(mask_BT)
    else:
        mask = (key_slot_S[None, :] <= query_slot_T[:, None])[None] & (mask_BS[:, None, :] > 0)
    model = transformer.decoder(config, params)
    h_BTD, (k_LBKHS, v_LBKSH), stats = model.run(
        input_ids_BT, positions_BT, mask, (cache.k_LBKHS, cache.v_LBKSH), cache.index
    )
    logits_BV = model.unembed(h_BTD[:, -1])
    new_cache = KVCache(
        k_LBKHS=k_LBKHS,
        v_LBKSH=v_LBKSH,
        mask_BS=mask_BS,
        pos_B=cache.pos_B + jnp.sum(mask_BT, axis=1),
        index=cache.index + T,
    )
    return logits_BV, new_cache, stats.experts_LmBTA


@functools.partial(jax.jit, static_argnums=0)
def decode_step(config: config_lib.ModelConfig, params, tokens_B, cache: KVCache | GroupKVCache):
    """Feeds one token per row (a real token, mask 1) at slot ``cache.index``.

    Takes and returns either cache form, with the same logits up to float rounding. A decode
    loop should use ``GroupKVCache`` (``group_cache``) and ``decode_params`` weights built
    before the loop: see ``GroupKVCache`` and ``DecodeParams`` for why (with a
    ``GroupKVCache``, plain ``params`` are converted on every call).

    Returns:
      (logits_BV float32 for the next token, updated cache).
    """
    if tokens_B.ndim != 1:
        raise ValueError(f"decode_step expects tokens_B of shape [B], got {tuple(tokens_B.shape)}")
    tokens_B1 = tokens_B[:, None]
    if isinstance(cache, KVCache):
        return prefill(config, params, tokens_B1, jnp.ones_like(tokens_B1, jnp.int32), cache)
    if not isinstance(params, DecodeParams):
        params = decode_params(config, params)
    logits_BV, cache, _ = _decode_layers(config, params, tokens_B, cache)
    return logits_BV, cache


@functools.partial(jax.jit, static_argnums=0)
def decode_step_and_routing(
    config: config_lib.ModelConfig, params: DecodeParams, tokens_B, cache: GroupKVCache
):
    """``decode_step`` on a ``GroupKVCache`` and the experts the fed tokens were routed to.

    Returns:
      (logits_BV float32, updated cache, experts_LmBA int32; Lm = 0 for a dense model).
    """
    return _decode_layers(config, params, tokens_B, cache)


@flax.struct.dataclass
class DecodeParams:
    """The weights in the layout of the per-layer decode (``decode_params``; decode loops).

    Activations of the per-layer decode are feature-major, [features, rows], and every
    projection is one matmul ``W_OI @ x_IB`` with the kernel stored as [out, in]: at decode
    shapes (a few dozen rows) XLA:CPU runs that 1.3-1.6x faster than ``x_BI @ W_IO`` (measured on
    SmolLM2-135M's projections, 32 rows). The layers are separate buffers, so a decode loop reads
    every weight in place (slices of the stacked params are copied each step, as a scan over
    stacked cache layers would copy the cache; see ``GroupKVCache``). Building it copies the
    layer weights once.

    Attributes:
      embed_VD: the token embedding (config.dtype cast at lookup, as ``Decoder``).
      head_VD: the output head as [V, D] in config.dtype: the embedding when tied, else the
        transposed ``lm_head/kernel``.
      final_norm_D: the final RMSNorm scale.
      layers: L dicts of arrays: ``input_norm`` / ``post_attn_norm`` [D]; kernels (config.dtype)
        ``q`` [N*H, D], ``k`` / ``v`` [K*H, D], ``o`` [D, N*H], ``gate`` / ``up`` [F, D], ``down``
        [D, F]; optional ``{q,k,v}_bias`` [n*H], ``q_norm`` / ``k_norm`` [H], and the LoRA
        adapters ``{proj}_lora_a`` [r, in] / ``{proj}_lora_b`` [out, r] of targeted projections.
        A MoE layer has ``moe_router`` [D, E], ``moe_gate_proj`` / ``moe_up_proj`` [E, D, F]
        and ``moe_down_proj`` [E, F, D] instead of ``gate`` / ``up`` / ``down``.
    """

    embed_VD: jax.Array
    head_VD: jax.Array
    final_norm_D: jax.Array
    layers: tuple[dict[str, jax.Array], ...]


# (DecodeParams name, params group, projection, number of kernel input axes)
_DECODE_PROJ = (
    ("q", "attn", "q_proj", 1),
    ("k", "attn", "k_proj", 1),
    ("v", "attn", "v_proj", 1),
    ("o", "attn", "o_proj", 2),
    ("gate", "mlp", "gate_proj", 1),
    ("up", "mlp", "up_proj", 1),
    ("down", "mlp", "down_proj", 1),
)


# The kernels of a MoE layer (grpo_jax/models/moe.py), as DecodeParams "moe_<name>".
_DECODE_MOE = ("router", "gate_proj", "up_proj", "down_proj")


def decode_params(config: config_lib.ModelConfig, params) -> DecodeParams:
    """The weights of ``params`` (base, plus LoRA adapters if attached) as ``DecodeParams``.

    Build it once, outside a decode loop, and pass it to ``decode_step`` with a ``GroupKVCache``.
    """
    c = config
    adapters = params.get(config_lib.ADAPTERS)
    base = {k: v for k, v in params.items() if k != config_lib.ADAPTERS}
    transformer.check_params(c, base)
    if adapters is not None:
        if not c.lora_rank:
            raise ValueError(
                f"params carry LoRA adapters (params[{config_lib.ADAPTERS!r}]) but "
                "ModelConfig.lora_rank=0"
            )
        transformer.check_adapters(c, adapters)
    dt = c.dtype

    def out_in(x, num_in):  # [*in, *out] -> [out, in]
        return x.reshape(math.prod(x.shape[:num_in]), -1).T.astype(dt)

    lp = base["layers"]
    layers = []
    for i in range(c.num_layers):
        layer = {
            "input_norm": lp["input_norm"]["scale"][i],
            "post_attn_norm": lp["post_attn_norm"]["scale"][i],
        }
        is_moe = c.moe_layers[i]
        for name, group, proj, num_in in _DECODE_PROJ:
            if group == "mlp" and is_moe:
                continue
            row = c.ffn_row(i) if group == "mlp" else i  # a MoE model stacks its dense MLPs
            node = lp[group][proj]
            layer[name] = out_in(node["kernel"][row], num_in)
            if "bias" in node:
                layer[f"{name}_bias"] = node["bias"][row].reshape(-1).astype(dt)
            lora = None if adapters is None else adapters["layers"].get(group, {}).get(proj)
            if lora is not None:
                layer[f"{name}_lora_a"] = out_in(lora["lora_a"][row], num_in)
                layer[f"{name}_lora_b"] = out_in(lora["lora_b"][row], 1)
        if is_moe:  # kept in the params' layout: the grouped matmuls take [E, in, out]
            for name in _DECODE_MOE:
                layer[f"moe_{name}"] = lp["moe"][name]["kernel"][c.ffn_row(i)].astype(dt)
        if c.qk_norm:
            layer["q_norm"] = lp["attn"]["q_norm"]["scale"][i]
            layer["k_norm"] = lp["attn"]["k_norm"]["scale"][i]
        layers.append(layer)
    embed_VD = base["embed"]["embedding"]
    head_VD = embed_VD if c.tie_word_embeddings else base["lm_head"]["kernel"].T
    return DecodeParams(
        embed_VD=embed_VD,
        head_VD=head_VD.astype(dt),
        final_norm_D=base["final_norm"]["scale"],
        layers=tuple(layers),
    )


def _decode_layers(
    config: config_lib.ModelConfig, params: DecodeParams, tokens_B, cache: GroupKVCache
):
    """``decode_step`` on a ``GroupKVCache``: layers unrolled, activations feature-major.

    The same computation as ``prefill`` at T = 1 (``Decoder`` modules: RMSNorm, rotary q/k with
    optional bias and q/k norm, GQA attention over the cache, SwiGLU MLP, LoRA unmerged), with
    the rows on the minor axis so each projection is ``W_OI @ x_IB`` (see ``DecodeParams``).
    The attention is ``_attend_group``'s.
    """
    c = config
    B = tokens_B.shape[0]
    N, K, H = c.num_heads, c.num_kv_heads, c.head_dim
    R = N // K
    if len(params.layers) != c.num_layers or len(cache.k_BKHC) != c.num_layers:
        raise ValueError(
            f"{len(params.layers)} layers of weights and {len(cache.k_BKHC)} of KV cache do not "
            f"match L={c.num_layers}"
        )
    if cache.row_B.shape[0] != B:
        raise ValueError(f"KV cache of {cache.row_B.shape[0]} rows for {B} tokens")
    index = cache.index
    cos_BTH, sin_BTH = transformer.rope_tables(c, cache.pos_B[:, None])
    cos_HB, sin_HB = cos_BTH[:, 0].T, sin_BTH[:, 0].T
    x_DB = embed_fm(c, params, tokens_B)
    new_k, new_v, experts = [], [], []
    for layer, w in enumerate(params.layers):
        q_NHB, k_KHB, v_KHB = qkv_fm(c, w, x_DB, cos_HB, sin_HB)
        k_BKHC = _write_block(cache.k_BKHC[layer], k_KHB.transpose(2, 0, 1)[..., None], index, 3)
        v_BKCH = _write_block(cache.v_BKCH[layer], v_KHB.transpose(2, 0, 1)[:, :, None], index, 2)
        q_BKRH = q_NHB.transpose(2, 0, 1).reshape(B, K, R, H)
        dt = attention_dtype(c, cache.prompt_k_PKHT[layer].dtype)
        o_BKRH = _attend_group(
            q_BKRH.astype(dt),
            cache.prompt_k_PKHT[layer].astype(dt),
            cache.prompt_v_PKTH[layer].astype(dt),
            cache.prompt_mask_PT,
            tuple(k.astype(dt) for k in k_BKHC),
            tuple(v.astype(dt) for v in v_BKCH),
            row_B=cache.row_B,
            n=cache.n,
            index=index,
        )
        x_DB, experts_BA = out_mlp_fm_routed(c, w, x_DB, o_BKRH.reshape(B, N * H).T)
        if experts_BA is not None:
            experts.append(experts_BA)
        new_k.append(k_BKHC)
        new_v.append(v_BKCH)
    logits_BV = head_logits_fm(c, params, x_DB)
    new_cache = dataclasses.replace(
        cache, k_BKHC=tuple(new_k), v_BKCH=tuple(new_v), pos_B=cache.pos_B + 1, index=index + 1
    )
    A = c.num_experts_per_tok
    experts_LmBA = jnp.stack(experts) if experts else jnp.zeros((0, B, A), jnp.int32)
    return logits_BV, new_cache, experts_LmBA


def embed_fm(c: config_lib.ModelConfig, params: DecodeParams, tokens_B):
    """The token embeddings of ``tokens_B`` feature-major, [D, B], in the compute dtype."""
    x_DB = jnp.take(params.embed_VD, tokens_B, axis=0).astype(c.dtype).T
    return nn.with_logical_constraint(x_DB, ("act_embed", "batch"))


def project_fm(c: config_lib.ModelConfig, w: dict, name: str, x_IB):
    """A projection of ``DecodeParams`` layer ``w`` feature-major, as ``_Proj``: ``W_OI @ x_IB``
    (+ LoRA, unmerged, + bias)."""
    dt = c.dtype
    y_OB = jnp.dot(w[name], x_IB.astype(dt))
    if f"{name}_lora_a" in w:
        lora_OB = jnp.dot(w[f"{name}_lora_b"], jnp.dot(w[f"{name}_lora_a"], x_IB.astype(dt)))
        y_OB = y_OB + lora_OB * c.lora_scale
    if f"{name}_bias" in w:
        y_OB = y_OB + w[f"{name}_bias"][:, None]
    return y_OB


def _rope_fm(x_nHB, cos_HB, sin_HB):
    """``_rope`` with the head dim on axis 1."""
    x1, x2 = jnp.split(x_nHB, 2, axis=1)
    rotated = jnp.concatenate([-x2, x1], axis=1)
    cos_1HB, sin_1HB = cos_HB[None].astype(x_nHB.dtype), sin_HB[None].astype(x_nHB.dtype)
    return x_nHB * cos_1HB + rotated * sin_1HB


def qkv_fm(c: config_lib.ModelConfig, w: dict, x_DB, cos_HB, sin_HB):
    """A layer's rotary-embedded (q_NHB, k_KHB, v_KHB) of the residual ``x_DB``, feature-major
    (input RMSNorm, projections, Qwen3's q/k norm, RoPE at the columns' positions)."""
    N, K, H, B = c.num_heads, c.num_kv_heads, c.head_dim, x_DB.shape[1]
    h_DB = _rms_norm_fm(x_DB, w["input_norm"], c.rms_norm_eps, c.dtype, axis=0)
    q_NHB = project_fm(c, w, "q", h_DB).reshape(N, H, B)
    k_KHB = project_fm(c, w, "k", h_DB).reshape(K, H, B)
    v_KHB = project_fm(c, w, "v", h_DB).reshape(K, H, B)
    if c.qk_norm:  # Qwen3: per-head RMSNorm before RoPE
        q_NHB = _rms_norm_fm(q_NHB, w["q_norm"], c.rms_norm_eps, c.dtype, axis=1)
        k_KHB = _rms_norm_fm(k_KHB, w["k_norm"], c.rms_norm_eps, c.dtype, axis=1)
    q_NHB = _rope_fm(q_NHB, cos_HB, sin_HB)
    q_NHB = nn.with_logical_constraint(q_NHB, ("act_heads", None, "batch"))
    return q_NHB, _rope_fm(k_KHB, cos_HB, sin_HB), v_KHB


def out_mlp_fm(c: config_lib.ModelConfig, w: dict, x_DB, o_XB):
    """The rest of a layer after attention, feature-major: the output projection of the heads'
    outputs ``o_XB`` ([N*H, B]) added to ``x_DB``, then the SwiGLU MLP block (or the MoE
    block of a MoE layer)."""
    return out_mlp_fm_routed(c, w, x_DB, o_XB)[0]


def out_mlp_fm_routed(c: config_lib.ModelConfig, w: dict, x_DB, o_XB):
    """``out_mlp_fm`` and, in a MoE layer, the experts each row was routed to.

    Returns:
      (x_DB, experts_BA int32 or None in a dense layer).
    """
    o_DB = project_fm(c, w, "o", o_XB)
    x_DB = x_DB + nn.with_logical_constraint(o_DB, ("act_embed", "batch"))
    h_DB = _rms_norm_fm(x_DB, w["post_attn_norm"], c.rms_norm_eps, c.dtype, axis=0)
    if "moe_router" in w:  # token-major for the router and the grouped matmuls
        y_BD, _, experts_BA, _ = moe.sparse_ffn(
            h_DB.T.astype(c.dtype),
            *(w[f"moe_{name}"] for name in _DECODE_MOE),
            num_experts_per_tok=c.num_experts_per_tok,
            norm_topk_prob=c.norm_topk_prob,
        )
        return x_DB + y_BD.T, experts_BA
    a_FB = jax.nn.silu(project_fm(c, w, "gate", h_DB)) * project_fm(c, w, "up", h_DB)
    a_FB = nn.with_logical_constraint(a_FB, ("act_mlp", "batch"))
    return x_DB + project_fm(c, w, "down", a_FB), None


def head_logits_fm(c: config_lib.ModelConfig, params: DecodeParams, x_DB):
    """float32 logits [B, V] of the final residual ``x_DB`` (final norm, then the head)."""
    # h back to [rows, D] for the head (as ``Decoder.unembed``). The barrier keeps XLA from
    # folding the transpose into the head's dot: XLA:CPU has no bf16 kernel for that form.
    h_BD = jax.lax.optimization_barrier(
        _rms_norm_fm(x_DB, params.final_norm_D, c.rms_norm_eps, c.dtype, axis=0).T
    )
    return jnp.einsum(
        "BD,VD->BV", h_BD.astype(c.dtype), params.head_VD, preferred_element_type=jnp.float32
    )


def _write_block(blocks, new, index, axis: int):
    """Writes ``new`` (size 1 on ``axis``) at response slot ``index`` of NB blocks of C slots.

    Every block takes a one-slot update at its clamped offset, with its old value except in
    block index // C: an in-place one-slot write per block and step, where choosing the block
    dynamically (a ``lax.switch`` returning the blocks) would copy them.
    """
    C = blocks[0].shape[axis]
    out = []
    for j, block in enumerate(blocks):
        start = [0] * block.ndim
        start[axis] = jnp.clip(index - j * C, 0, C - 1)
        old = jax.lax.dynamic_slice(block, start, new.shape)
        out.append(
            jax.lax.dynamic_update_slice(
                block, jnp.where(index // C == j, new.astype(block.dtype), old), start
            )
        )
    return tuple(out)


_BATCH_KV = ((0, 1), (0, 1))  # dot_general batch dims: (row or prompt, kv head)


def _softmax_parts(s_xkQS, v_xkSH):
    """Unnormalised softmax attention over one key range: (max [x,k,Q,1], sum [x,k,Q,1],
    out [x,k,Q,H]), merged across ranges by ``_attend_group`` (log-sum-exp). ``v_xkSH`` is a
    tuple of blocks splitting S (one product each: concatenating them would copy the cache)."""
    m = jnp.max(s_xkQS, axis=-1, keepdims=True)
    e = jnp.exp(s_xkQS - m)
    o, start = 0.0, 0
    for v in v_xkSH:
        size = v.shape[2]
        e_block = e[..., start : start + size].astype(v.dtype)
        o = o + jax.lax.dot_general(
            e_block, v, (((3,), (2,)), _BATCH_KV), preferred_element_type=jnp.float32
        )
        start += size
    return m, jnp.sum(e, axis=-1, keepdims=True), o


def _attend_group(q_BKRH, k_PKHT, v_PKTH, mask_PT, k_BKHC, v_BKCH, *, row_B, n: int, index):
    """GQA attention of B decode rows over their prompt (shared per group) and their response.

    Equals ``_attend`` over the row's whole sequence (prompt, then the index + 1 response slots
    written, the current one included), up to float rounding: the two key ranges are softmaxed
    separately and merged by log-sum-exp.

    Prompt part: the rows are placed at their rollout rows (a [P * n] scatter, skipped when the
    B rows are all of them in order, as before any row is dropped), so each prompt's keys are
    read once for its n rows: one product per (prompt, kv head) with n * R query rows.
    Response part: ``lax.switch`` on the written blocks, so unwritten blocks are not read.

    Args:
      q_BKRH: queries, R = N / K query heads per kv head.
      k_PKHT, v_PKTH, mask_PT: the prompts (``GroupKVCache``); q and the keys and values in
        one dtype, the wider of the compute and cache dtypes.
      k_BKHC, v_BKCH: the NB response blocks of this layer.
      row_B: the rollout row of each row; n: rows per prompt; index: the current slot.

    Returns:
      o_BKRH float32.
    """
    B, K, R, H = q_BKRH.shape
    P = mask_PT.shape[0]
    scale = H**-0.5
    neg = jnp.finfo(jnp.float32).min
    dims = (((3,), (2,)), _BATCH_KV)
    identity = B == P * n  # rows are only ever dropped, so all P * n rows are in order
    q_PnKRH = (
        q_BKRH if identity else jnp.zeros((P * n, K, R, H), q_BKRH.dtype).at[row_B].set(q_BKRH)
    )
    # [P*n, K, R, H] -> [P, K, n*R, H]: the n rows of a prompt are query rows of one product.
    q_PKQH = q_PnKRH.reshape(P, n, K, R, H).transpose(0, 2, 1, 3, 4).reshape(P, K, n * R, H)
    s_PKQT = jax.lax.dot_general(q_PKQH, k_PKHT, dims, preferred_element_type=jnp.float32) * scale
    s_PKQT = jnp.where(mask_PT[:, None, None, :] > 0, s_PKQT, neg)

    def to_rows(x_PKQX):  # [P, K, n*R, X] -> [B, K, R, X]
        X = x_PKQX.shape[-1]
        x_PnKRX = x_PKQX.reshape(P, K, n, R, X).transpose(0, 2, 1, 3, 4).reshape(P * n, K, R, X)
        return x_PnKRX if identity else x_PnKRX[row_B]

    m_p, l_p, o_p = (to_rows(x) for x in _softmax_parts(s_PKQT, (v_PKTH,)))

    C = k_BKHC[0].shape[3]

    def response(num_blocks):  # the first num_blocks blocks: slots [0, num_blocks * C)
        def attend(q_BKRH, k_BKHC, v_BKCH, index):
            s_BKRS = (
                jnp.concatenate(
                    [
                        jax.lax.dot_general(q_BKRH, k, dims, preferred_element_type=jnp.float32)
                        for k in k_BKHC[:num_blocks]
                    ],
                    axis=-1,
                )
                * scale
            )
            s_BKRS = jnp.where(jnp.arange(num_blocks * C) <= index, s_BKRS, neg)
            return _softmax_parts(s_BKRS, v_BKCH[:num_blocks])

        return attend

    branches = [response(j + 1) for j in range(len(k_BKHC))]
    m_r, l_r, o_r = jax.lax.switch(index // C, branches, q_BKRH, k_BKHC, v_BKCH, index)
    m = jnp.maximum(m_p, m_r)
    a_p, a_r = jnp.exp(m_p - m), jnp.exp(m_r - m)
    return (o_p * a_p + o_r * a_r) / (l_p * a_p + l_r * a_r)


def _rms_norm_fm(x, scale, eps: float, dtype, *, axis: int):
    """``RMSNorm`` over ``axis`` (float32 statistics), the scale broadcast along that axis."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axis, keepdims=True) + eps)
    shape = [1] * x.ndim
    shape[axis] = -1
    return y.astype(dtype) * scale.astype(dtype).reshape(shape)
