"""The GPT model: one module, top to bottom, single-device PyTorch.

Everything an architecture family needs is a field of `Config`; nothing here knows about model names or about
parallelism. Parameters may be created on the `meta` device and materialized later with `init_weights`.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from litgpt.config import Config


class GPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=config.lm_head_bias)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
                h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
                ln_f=build_norm(config, config.n_embd),
            )
        )
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        # Rotary tables are derived, not state: rebuilt on first use per device (meta init and FSDP stay simple).
        self._rope_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    # ---- rotary tables -----------------------------------------------------------------------------------------------
    def rope_tables(self, device: torch.device, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for positions 0..block_size-1, float32, shape (block_size, rope_n_elem); with LongRoPE
        (2, block_size, rope_n_elem): the short factors' tables, then the long ones'."""
        key = (device, local)
        if key not in self._rope_cache:
            c = self.config
            base = c.rope_local_base if local else c.rope_base
            scaling = None if local else c.rope_scaling
            self._rope_cache[key] = build_rope_cache(c.block_size, c.rope_n_elem, base, scaling, device)
        return self._rope_cache[key]

    def rope_at(
        self, device: torch.device, local: bool, T: int, positions: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of this forward pass' positions: 0..T-1 without `positions`, else (T, n) for positions (T,)
        and (B, 1, T, n) for per-row positions (B, T), broadcasting over the heads.

        LongRoPE picks its short or long factors once per forward pass, as transformers does: the long ones when a
        position lies past original_max_position_embeddings (T > original without a cache, max(positions) >= original
        with one), for every position of the pass; with per-row positions, per row (each request as if alone). The
        choice stays on the device (no host sync). Keys already cached keep the factors they were written with:
        `litgpt.generate.longrope_restart` says when generation runs the sequence again.
        """
        cos, sin = self.rope_tables(device, local)
        longrope = cos.dim() == 3
        original = self.config.rope_scaling["original_max_position_embeddings"] if longrope else 0
        if positions is None:
            if longrope:
                cos, sin = cos[int(T > original)], sin[int(T > original)]
            return cos[:T], sin[:T]
        if longrope:
            which = (positions.amax(dim=-1, keepdim=True) >= original).long().expand_as(positions)
            cos, sin = cos[which, positions], sin[which, positions]
        else:
            cos, sin = cos[positions], sin[positions]
        if positions.dim() == 2:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return cos, sin

    # ---- KV cache -----------------------------------------------------------------------------------------------------
    def set_kv_cache(self, batch_size: int, max_seq_length: Optional[int] = None, device=None, dtype=None) -> None:
        """Allocate a static key/value cache in every layer for incremental decoding."""
        max_seq_length = max_seq_length or self.config.block_size
        param = self.lm_head.weight
        for block in self.transformer.h:
            block.attn.kv_cache = block.attn.new_kv_cache(
                batch_size, max_seq_length, device=device or param.device, dtype=dtype or param.dtype
            )

    def clear_kv_cache(self) -> None:
        for block in self.transformer.h:
            block.attn.kv_cache = None

    # ---- forward ------------------------------------------------------------------------------------------------------
    def forward(
        self, idx: torch.Tensor, input_pos: Optional[torch.Tensor] = None, *, return_hidden: bool = False,
        sample_positions: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Logits for token ids `idx` (B, T); with `return_hidden`, the final norm's output (B, T, n_embd) instead,
        for a loss that applies the head itself chunk by chunk (`litgpt.train.loss.model_loss`).

        Without `input_pos` the sequence starts at position 0 and no cache is used (training, scoring). With it,
        `input_pos` (T,) gives the positions of `idx` and every layer reads and writes its KV cache. Queries then
        attend to the whole cache through a mask that hides the positions not written yet: the shapes do not depend
        on the position, so decoding needs no host-device sync and one compiled graph serves every step.
        `input_pos` (B, T) gives each row its own positions (rows 0..B-1 of the cache: a server's batch of requests
        of different lengths).

        `sample_positions` (B, T), without a cache, is packed training data (`litgpt.data.packing`): each token's
        position within its own sample, 0 where a sample starts. RoPE reads these positions and attention stays
        within each sample (a block-diagonal causal mask), so every sample sees what it would see alone.
        """
        c = self.config
        T = idx.size(1)
        if input_pos is None:
            if T > c.block_size:
                raise ValueError(f"Sequence length {T} exceeds the model's block size {c.block_size}.")
            positions = None
            kv_length = T
        else:
            cache = self.transformer.h[0].attn.kv_cache
            if cache is None:
                raise RuntimeError("input_pos was given but no KV cache is set: call model.set_kv_cache(...) first.")
            positions = input_pos
            kv_length = cache.k.size(2)

        for block in self.transformer.h:
            if isinstance(block.mlp, LLaMAMoE):
                block.mlp.router_stats = None  # each MoE layer records this pass' routing (router_aux_loss)

        x = self.transformer.wte(idx)
        if c.scale_embeddings:
            x = x * torch.tensor(c.n_embd**0.5, dtype=x.dtype)

        ropes = {}
        for local in {c.rope_local_base is not None and c.is_sliding_layer(i) for i in range(c.n_layer)}:
            # packed samples (sample_positions) rotate by their own positions
            cos, sin = self.rope_at(x.device, local, T, positions if sample_positions is None else sample_positions)
            ropes[local] = (cos.to(x.dtype), sin.to(x.dtype))

        masks = {}
        for window in {c.sliding_window_size if c.is_sliding_layer(i) else None for i in range(c.n_layer)}:
            masks[window] = attention_mask(T, kv_length, positions, window, x.device, sample_positions)

        for i, block in enumerate(self.transformer.h):
            sliding = c.is_sliding_layer(i)
            rope = ropes[c.rope_local_base is not None and sliding] if c.uses_rope(i) else None
            mask = masks[c.sliding_window_size if sliding else None]
            x = block(x, rope, mask, positions)

        x = self.transformer.ln_f(x)
        if return_hidden:
            return x
        logits = self.lm_head(x)
        if c.final_logit_softcapping is not None:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits

    def router_aux_loss(self) -> Optional[torch.Tensor]:
        """The load-balancing loss of the latest forward pass, times `config.router_aux_loss_coef`, in the autograd
        graph; None without MoE layers or with a coefficient of 0.

        Switch Transformer's loss as Mixtral and Qwen3-MoE define it (transformers' `load_balancing_loss_func`):
        n_expert * sum_e f_e * P_e, where f_e is the fraction of top-k assignments that went to expert e and P_e the
        mean router probability of e, both taken over every token of every MoE layer together.
        """
        coef = self.config.router_aux_loss_coef
        layers = [block.mlp for block in self.transformer.h if isinstance(block.mlp, LLaMAMoE)]
        if not layers or not coef:
            return None
        stats = [layer.router_stats for layer in layers]
        if any(s is None for s in stats):
            raise RuntimeError("router_aux_loss() reads the routing of a forward pass: call the model first.")
        rows = sum(s.rows for s in stats)
        fraction = torch.stack([s.counts for s in stats]).sum(dim=0) / rows
        probability = torch.stack([s.prob_sum for s in stats]).sum(dim=0) / rows
        return coef * self.config.n_expert * (fraction * probability).sum()

    # ---- initialization -------------------------------------------------------------------------------------------------
    def to_empty(self, *, device, recurse: bool = True) -> "GPT":
        """Materialize meta parameters (uninitialized) on `device`, keeping the embedding tie."""
        super().to_empty(device=device, recurse=recurse)
        if self.config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        return self

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialize every parameter in place (also after `to_empty` from the meta device).

        Normal(0, 0.02) for embeddings and linear weights, scaled down by sqrt(2 * n_layer) for the projections
        that write into the residual stream (GPT-2's scheme); zero biases; norms start as identity.
        """
        std = 0.02
        residual_std = std / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                is_residual_out = name.endswith(".proj")
                nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual_out else std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
                if isinstance(module, Router) and module.e_score_correction_bias is not None:
                    nn.init.zeros_(module.e_score_correction_bias)
            elif isinstance(module, (RMSNorm, nn.LayerNorm, HeadwiseLayerNorm)):
                module.reset_parameters()
            if isinstance(module, CausalSelfAttention) and module.config.attention_sinks:
                nn.init.zeros_(module.sinks)  # a sink of logit 0: one more key of score 0 and value 0
        self._rope_cache.clear()


class Block(nn.Module):
    def __init__(self, config: Config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.norm_1 = build_norm(config, config.n_embd) if config.norm_1 else nn.Identity()
        self.attn = build_attention(config, layer_idx)
        self.post_attention_norm = build_norm(config, config.n_embd) if config.post_attention_norm else nn.Identity()
        shares_norm = config.parallel_residual and config.shared_attention_norm
        self.norm_2 = None if shares_norm else build_norm(config, config.n_embd) if config.norm_2 else nn.Identity()
        self.mlp = build_mlp(config, layer_idx)
        self.post_mlp_norm = build_norm(config, config.n_embd) if config.post_mlp_norm else nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        rope: Optional[tuple[torch.Tensor, torch.Tensor]],
        mask: Optional[torch.Tensor],
        input_pos: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        x_normed = self.norm_1(x)
        attention_out = self.post_attention_norm(self.attn(x_normed, rope, mask, input_pos))
        if self.config.parallel_residual:
            mlp_in = x_normed if self.norm_2 is None else self.norm_2(x)
            return x + attention_out + self.post_mlp_norm(self.mlp(mlp_in))
        x = x + attention_out
        return x + self.post_mlp_norm(self.mlp(self.norm_2(x)))


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        # q, k and v of all heads in one matmul; rows are laid out [q heads | k groups | v groups].
        self.qkv = nn.Linear(config.n_embd, config.qkv_size, bias=config.bias or config.attn_bias)
        self.proj = nn.Linear(config.n_head * config.head_size, config.n_embd, bias=config.bias)
        if config.norm_qk and config.norm_qk_per_head:
            self.norm_q = HeadwiseLayerNorm(config.n_head, config.head_size, config.norm_eps)
            self.norm_k = HeadwiseLayerNorm(config.n_query_groups, config.head_size, config.norm_eps)
        elif config.norm_qk:
            # Per head, or over the whole projection of all heads (OLMo 2's "olmo2").
            whole = config.norm_qk_type == "olmo2"
            self.norm_q = build_norm(config, config.head_size * (config.n_head if whole else 1))
            self.norm_k = build_norm(config, config.head_size * (config.n_query_groups if whole else 1))
        if config.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(config.n_head))
        self.kv_cache: Optional[KVCache] = None
        self.scale = 1.0 / math.sqrt(config.attention_scores_scalar or config.head_size)

    def new_kv_cache(self, batch_size: int, max_seq_length: int, device=None, dtype=None) -> "KVCache":
        """An empty cache of this layer's keys and values for `max_seq_length` positions of `batch_size` rows."""
        c = self.config
        return KVCache(batch_size, c.n_query_groups, max_seq_length, c.head_size, device=device, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,
        rope: Optional[tuple[torch.Tensor, torch.Tensor]],
        mask: Optional[torch.Tensor],
        input_pos: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """`rope` None: a layer without rotary embedding (NoPE)."""
        c = self.config
        B, T, _ = x.shape
        qkv = self.qkv(x)
        if c.clip_qkv is not None:
            qkv = qkv.clamp(-c.clip_qkv, c.clip_qkv)
        q, k, v = qkv.split(
            (c.n_head * c.head_size, c.n_query_groups * c.head_size, c.n_query_groups * c.head_size), dim=-1
        )
        whole_qk_norm = c.norm_qk and c.norm_qk_type == "olmo2"
        if whole_qk_norm:
            q, k = self.norm_q(q), self.norm_k(k)
        q = q.view(B, T, c.n_head, c.head_size).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, c.n_query_groups, c.head_size).transpose(1, 2)  # (B, ng, T, hs)
        v = v.view(B, T, c.n_query_groups, c.head_size).transpose(1, 2)
        if c.norm_qk and not whole_qk_norm:
            q, k = self.norm_q(q), self.norm_k(k)
        if rope is not None:
            cos, sin = rope
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)

        if input_pos is not None:
            k, v = self.kv_cache.update(input_pos, k, v)

        y = self.attend(q, k, v, mask)
        y = y.transpose(1, 2).reshape(B, T, c.n_head * c.head_size)
        return self.proj(y)

    def attend_with_sink_key(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """Attention with sinks through SDPA (its memory-efficient kernels, no score matrix kept): one more key that
        only the sink reaches. Queries get one more element, sink / scale, which real keys meet with 0 and the extra
        key with 1, so its score is the head's sink; its value is 0, so it only joins the softmax's denominator.
        Queries, keys and values are padded by 8 elements to keep their size a multiple of 8 for the fused kernels."""
        c = self.config
        (B, nh, T, hs), S = q.shape, k.size(-2)
        sink = (self.sinks / self.scale).to(q.dtype).view(1, nh, 1, 1).expand(B, nh, T, 1)
        q = torch.cat((q, sink, q.new_zeros(B, nh, T, 7)), dim=-1)
        sink_key = torch.zeros(hs + 8, dtype=k.dtype, device=k.device)
        sink_key[hs] = 1
        k = torch.cat((F.pad(k, (0, 8)), sink_key.expand(B, k.size(1), 1, hs + 8)), dim=2)
        v = F.pad(v, (0, 8, 0, 1))  # values as wide as the keys: the memory-efficient kernels need it
        if mask is None:
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
        mask = F.pad(mask, (0, 1), value=True)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=c.n_query_groups != c.n_head
        )
        return y[..., :hs]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        c = self.config
        if c.attention_sinks and c.attention_logit_softcapping is None:
            return self.attend_with_sink_key(q, k, v, mask)
        if c.attention_logit_softcapping is None:
            # mask None means plain causal attention over the whole sequence.
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                enable_gqa=c.n_query_groups != c.n_head,
            )
        # Soft-capping squashes the scores before the softmax, which SDPA cannot express.
        if c.n_query_groups != c.n_head:
            repeats = c.n_head // c.n_query_groups
            k = k.repeat_interleave(repeats, dim=1)
            v = v.repeat_interleave(repeats, dim=1)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        cap = c.attention_logit_softcapping
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        if mask is None:
            T, S = q.size(-2), k.size(-2)
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        if not c.attention_sinks:
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            return weights @ v
        # The sink's logit joins each row's softmax as one more column, which is then dropped: the row's weights
        # sum to less than one by the sink's share.
        sink = self.sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1, dtype=torch.float32)
        return weights[..., :-1].to(q.dtype) @ v


class KVCache(nn.Module):
    """A static cache of keys and values, (B, n_query_groups, max_seq_length, head_size); values may have their own
    v_head_size. Latent attention keeps its compressed latent in `k` and its rotary key in `v` (one group)."""

    def __init__(
        self, batch_size, n_query_groups, max_seq_length, head_size, device=None, dtype=None,
        v_head_size: Optional[int] = None, latent: bool = False,
    ) -> None:
        super().__init__()
        self.latent = latent  # holds latent attention's compressed latent and rotary key
        shape = (batch_size, n_query_groups, max_seq_length, head_size)
        v_shape = shape[:-1] + (v_head_size or head_size,)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(v_shape, device=device, dtype=dtype), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k and v (B, ng, T, hs) at `input_pos` (T,) and return the whole cache; or, with `input_pos` (B, T),
        write row b at its own positions input_pos[b] and return the cache's first B rows."""
        if input_pos.dim() == 2:
            rows = torch.arange(input_pos.size(0), device=input_pos.device)[:, None]
            self.k[rows, :, input_pos] = k.transpose(1, 2).to(self.k.dtype)  # indexed as (B, T, ng, hs)
            self.v[rows, :, input_pos] = v.transpose(1, 2).to(self.v.dtype)
            return self.k[: input_pos.size(0)], self.v[: input_pos.size(0)]
        self.k.index_copy_(2, input_pos, k.to(self.k.dtype))
        self.v.index_copy_(2, input_pos, v.to(self.v.dtype))
        return self.k, self.v


class MultiheadLatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434): every head's keys and values are expanded from one
    shared latent per token (kv_lora_rank elements, RMS-normalized) plus one rotary key shared by the heads, so the KV
    cache can hold just those kv_lora_rank + qk_rope_head_dim elements per token and layer.

    Modules: the query through `q_a_proj` -> `q_a_norm` -> `q_b_proj` (or one `q_proj` without q_lora_rank);
    `kv_a_proj` gives the latent and the rotary key, `kv_a_norm` normalizes the latent, `kv_b_proj` expands it into
    each head's unrotated key and value; `proj` is the output projection. Same forward signature as
    `CausalSelfAttention`.
    """

    # DeepSeek's latent norms use this epsilon whatever the model's norm_eps (transformers hard-codes it too).
    LATENT_NORM_EPS = 1e-6

    def __init__(self, config: Config, layer_idx: int) -> None:
        super().__init__()
        c = self.config = config
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.n_embd, c.n_head * c.head_size, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.n_embd, c.q_lora_rank, bias=c.bias)
            self.q_a_norm = RMSNorm(c.q_lora_rank, eps=self.LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(c.q_lora_rank, c.n_head * c.head_size, bias=False)
        self.kv_a_proj = nn.Linear(c.n_embd, c.kv_lora_rank + c.qk_rope_head_dim, bias=c.bias)
        self.kv_a_norm = RMSNorm(c.kv_lora_rank, eps=self.LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, c.n_head * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.proj = nn.Linear(c.n_head * c.v_head_dim, c.n_embd, bias=c.bias)
        self.kv_cache: Optional[KVCache] = None
        self.scale = latent_attention_scale(c)

    def new_kv_cache(
        self, batch_size: int, max_seq_length: int, device=None, dtype=None, latent: bool = True
    ) -> KVCache:
        """The compressed cache (`latent`: kv_lora_rank + qk_rope_head_dim elements per token) or every head's full
        key and value (n_head * (head_size + v_head_dim) elements per token, expanded once when written)."""
        c = self.config
        if latent:
            return KVCache(batch_size, 1, max_seq_length, c.kv_lora_rank, device, dtype, c.qk_rope_head_dim, True)
        return KVCache(batch_size, c.n_head, max_seq_length, c.head_size, device, dtype, c.v_head_dim)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: Optional[torch.Tensor],
        input_pos: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        c = self.config
        B, T, _ = x.shape
        q = self.q_proj(x) if c.q_lora_rank is None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(B, T, c.n_head, c.head_size).transpose(1, 2).split(
            (c.qk_nope_head_dim, c.qk_rope_head_dim), dim=-1
        )
        latent, k_rope = self.kv_a_proj(x).split((c.kv_lora_rank, c.qk_rope_head_dim), dim=-1)
        latent = self.kv_a_norm(latent).unsqueeze(1)  # (B, 1, T, kv_lora_rank)
        cos, sin = rope
        rotate = apply_rope_interleaved if c.rope_interleaved else apply_rope
        q_rope, k_rope = rotate(q_rope, cos, sin), rotate(k_rope.unsqueeze(1), cos, sin)  # k_rope (B, 1, T, n)

        cache = self.kv_cache if input_pos is not None else None
        if cache is not None and cache.latent:
            latent, k_rope = cache.update(input_pos, latent, k_rope)
            if T == 1 and type(self.kv_b_proj) is nn.Linear:
                y = self.attend_latent(q_nope, q_rope, latent, k_rope, mask)
                return self.proj(y.transpose(1, 2).reshape(B, T, c.n_head * c.v_head_dim))
        k, v = self.expand(latent, k_rope)
        if cache is not None and not cache.latent:
            k, v = cache.update(input_pos, k, v)

        q = torch.cat((q_nope, q_rope), dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return self.proj(y.transpose(1, 2).reshape(B, T, c.n_head * c.v_head_dim))

    def attend_latent(self, q_nope, q_rope, latent, k_rope, mask) -> torch.Tensor:
        """Attention over the cached latents themselves, without expanding them (one decoded token): kv_b_proj's
        key rows are folded into the query and its value rows applied after the attention, so a step costs
        O(cache length * kv_lora_rank) per head instead of expanding every cached position. The same products in
        another order: equal up to rounding. Returns (B, nh, T, v_head_dim)."""
        c = self.config
        w = self.kv_b_proj.weight.view(c.n_head, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        w_k, w_v = w.split((c.qk_nope_head_dim, c.v_head_dim), dim=1)
        q = torch.cat((q_nope @ w_k, q_rope), dim=-1)  # (B, nh, T, kv_lora_rank + qk_rope_head_dim)
        k = torch.cat((latent, k_rope), dim=-1).expand(-1, c.n_head, -1, -1)
        v = latent.expand(-1, c.n_head, -1, -1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return y @ w_v.transpose(1, 2)

    def expand(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head's key (B, nh, S, head_size) and value (B, nh, S, v_head_dim) from the latent (B, 1, S, r) and
        the shared rotary key (B, 1, S, qk_rope_head_dim)."""
        c = self.config
        B, _, S, _ = latent.shape
        kv = self.kv_b_proj(latent).view(B, S, c.n_head, c.qk_nope_head_dim + c.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split((c.qk_nope_head_dim, c.v_head_dim), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, c.n_head, -1, -1)), dim=-1)
        return k, v


def latent_attention_scale(config: Config) -> float:
    """The softmax scale of latent attention: 1/sqrt(head_size), times YaRN's mscale(factor, mscale_all_dim) squared
    when the rotary scaling sets mscale_all_dim (DeepSeek tempers the scores themselves, not only cos and sin)."""
    scale = 1.0 / math.sqrt(config.attention_scores_scalar or config.head_size)
    scaling = config.rope_scaling or {}
    if scaling.get("mscale_all_dim") and scaling["factor"] > 1:
        mscale = 0.1 * scaling["mscale_all_dim"] * math.log(scaling["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


def build_attention(config: Config, layer_idx: int) -> nn.Module:
    """Latent attention when the config sets kv_lora_rank, else the fused q/k/v attention."""
    if config.kv_lora_rank is not None:
        return MultiheadLatentAttention(config, layer_idx)
    return CausalSelfAttention(config, layer_idx)


def attention_mask(
    q_len: int, kv_length: int, input_pos: Optional[torch.Tensor], window: Optional[int], device: torch.device,
    sample_positions: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """Boolean (q_len, kv_length) mask, True where a query may attend, or (B, 1, q_len, kv_length) for per-row
    positions (B, q_len) or packed samples (`sample_positions` (B, q_len), no cache: block-diagonal, each token sees
    its own sample's earlier tokens only); None for plain causal attention."""
    if input_pos is None and window is None and sample_positions is None:
        return None
    q_pos = input_pos if input_pos is not None else torch.arange(q_len, device=device)
    k_pos = torch.arange(kv_length, device=device)
    allowed = k_pos <= q_pos[..., None]
    if window is not None:
        allowed &= k_pos > q_pos[..., None] - window
    if sample_positions is not None:
        sample = (sample_positions == 0).cumsum(dim=1)  # which sample of the row each token belongs to
        allowed = allowed & (sample[:, :, None] == sample[:, None, :])
    return allowed.unsqueeze(1) if allowed.dim() == 3 else allowed


# ---- rotary position embeddings --------------------------------------------------------------------------------------
def build_rope_cache(
    seq_len: int, n_elem: int, base: float, scaling: Optional[dict], device: Optional[torch.device] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions 0..seq_len-1 (seq_len, n_elem), float32; for LongRoPE (2, seq_len, n_elem), the
    tables of the short factors and of the long ones (`GPT.rope_at` picks one per forward pass)."""
    if scaling is not None and scaling["type"] == "longrope":
        short, long, attention_factor = longrope_frequencies(n_elem, base, scaling, seq_len, device)
        tables = [_rope_table(seq_len, inv_freq, attention_factor) for inv_freq in (short, long)]
        return torch.stack([t[0] for t in tables]), torch.stack([t[1] for t in tables])
    inv_freq, attention_factor = rope_frequencies(n_elem, base, scaling, device)
    return _rope_table(seq_len, inv_freq, attention_factor)


def _rope_table(seq_len: int, inv_freq: torch.Tensor, attention_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(seq_len, device=inv_freq.device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)  # the rotate-half layout of Hugging Face checkpoints
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def longrope_frequencies(
    n_elem: int, base: float, scaling: dict, max_positions: int, device=None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """LongRoPE (Phi-3.5, Phi-4-mini): inverse frequencies divided by per-frequency factors, one set for contexts up
    to original_max_position_embeddings and one past it, and the factor applied to cos/sin. Without `factor` or
    `attention_factor` the context extension is max_positions (block_size) / original, as transformers derives it
    from max_position_embeddings."""
    original = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        factor = scaling.get("factor") or max_positions / original
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    base_freq = base ** (torch.arange(0, n_elem, 2, device=device, dtype=torch.float32) / n_elem)
    short, long = (
        1.0 / (torch.tensor(scaling[key], dtype=torch.float32, device=device) * base_freq)
        for key in ("short_factor", "long_factor")
    )
    return short, long, float(attention_factor)


def rope_frequencies(n_elem: int, base: float, scaling: Optional[dict], device=None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of the rotary embedding (n_elem // 2,) and the factor applied to cos/sin."""
    exponents = torch.arange(0, n_elem, 2, device=device, dtype=torch.float32) / n_elem
    inv_freq = 1.0 / (base**exponents)
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["type"]
    factor = scaling["factor"]
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended smoothly.
        original = scaling["original_max_position_embeddings"]
        low_wavelen = original / scaling["low_freq_factor"]
        high_wavelen = original / scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - scaling["low_freq_factor"]) / (
            scaling["high_freq_factor"] - scaling["low_freq_factor"]
        )
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(in_band, blended, scaled), 1.0
    if kind == "yarn":
        return yarn_frequencies(n_elem, base, scaling, device)
    if kind == "longrope":
        raise ValueError("LongRoPE has two sets of frequencies: use longrope_frequencies.")
    raise ValueError(f"Unknown rope scaling type {kind!r}")


def yarn_frequencies(n_elem: int, base: float, scaling: dict, device=None) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv:2309.00071): interpolate low frequencies, extrapolate high ones, temper the attention."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return n_elem * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(scaling.get("beta_fast") or 32)
    high = correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, n_elem - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(n_elem // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, n_elem, 2, device=device, dtype=torch.float32) / n_elem)
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.size(-1) elements of every head of x (B, nh, T, hs)."""
    n_elem = cos.size(-1)
    if n_elem == 0:
        return x
    rotated, passed = x[..., :n_elem], x[..., n_elem:]
    half = n_elem // 2
    x1, x2 = rotated[..., :half], rotated[..., half:]
    rotated = rotated * cos + torch.cat((-x2, x1), dim=-1) * sin
    if passed.size(-1) == 0:
        return rotated
    return torch.cat((rotated, passed), dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x0, x1), (x2, x3), ... of x (B, nh, T, n) by the angles of the rotate-half tables cos and
    sin (T, n), written back de-interleaved (rotated evens, then rotated odds): queries and keys get the same
    permutation, so their products are those of the interleaved rotation (DeepSeek's layout)."""
    half = cos.size(-1) // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


# ---- norms ---------------------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps
        self.unit_offset = unit_offset
        self.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RMSNormFunction.apply(x, self.weight, self.eps, self.unit_offset)

    def reset_parameters(self) -> None:
        # Identity at init: weight 1, or 0 when the scale is (1 + weight).
        nn.init.zeros_(self.weight) if self.unit_offset else nn.init.ones_(self.weight)


class RMSNormFunction(torch.autograd.Function):
    """x / rms(x) * weight, computed in float32 like transformers, keeping only the input and 1 / rms(x) for the
    backward pass. Left to autograd, the ops would keep the float32 copy of the input and the normalized output as
    well: 6 bytes per element of a 16-bit input instead of 2, twice per block."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
        x_float = x.float()
        inv_rms = torch.rsqrt(x_float.pow(2).mean(dim=-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, inv_rms)
        ctx.unit_offset = unit_offset
        normed = x_float * inv_rms
        if unit_offset:
            # Gemma scales in float32 before casting back.
            return (normed * (1.0 + weight.float())).to(x.dtype)
        return weight * normed.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, inv_rms = ctx.saved_tensors
        normed = x.float() * inv_rms
        if ctx.unit_offset:
            grad_float = grad.float()
            grad_weight = _sum_to_last_dim(grad_float * normed).to(weight.dtype)
            grad_normed = grad_float * (1.0 + weight.float())
        else:
            normed_cast = normed.to(x.dtype)
            grad_weight = _sum_to_last_dim(grad * normed_cast).to(weight.dtype)
            grad_normed = (grad * weight).to(x.dtype).float()
        # d(x * r)/dx with r = 1 / rms(x): r * (g - n * mean(g * n)), n the normalized input.
        grad_x = inv_rms * (grad_normed - normed * (grad_normed * normed).mean(dim=-1, keepdim=True))
        # The weight's gradient is returned even when it is frozen (autograd drops it): compilers that trace this
        # backward (thunder) do not know ctx.needs_input_grad.
        return grad_x.to(x.dtype), grad_weight, None, None


def _sum_to_last_dim(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.size(-1)).sum(dim=0)


def build_norm(config: Config, size: int) -> nn.Module:
    if config.norm_class_name == "RMSNorm":
        return RMSNorm(size, eps=config.norm_eps, unit_offset=config.norm_unit_offset)
    return nn.LayerNorm(size, eps=config.norm_eps, bias=True, elementwise_affine=config.norm_affine)


class HeadwiseLayerNorm(nn.Module):
    """LayerNorm over each head of x (B, n_heads, T, head_size) with a weight of its own per head and no bias
    (StableLM 2's q/k norms). The weight is kept flat, (n_heads * head_size,), one head after another."""

    def __init__(self, n_heads: int, head_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n_heads * head_size))
        self.n_heads, self.head_size, self.eps = n_heads, head_size, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.layer_norm(x, (self.head_size,), eps=self.eps)
        return normed * self.weight.view(self.n_heads, 1, self.head_size)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


# ---- MLPs ------------------------------------------------------------------------------------------------------------------
class GptNeoxMLP(nn.Module):
    def __init__(self, config: Config, intermediate_size: Optional[int] = None) -> None:
        super().__init__()
        size = intermediate_size or config.intermediate_size
        self.fc = nn.Linear(config.n_embd, size, bias=config.bias)
        self.proj = nn.Linear(size, config.n_embd, bias=config.bias)
        self.approximate = config.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


class LLaMAMLP(nn.Module):
    """SwiGLU: proj(silu(fc_1(x)) * fc_2(x))."""

    def __init__(self, config: Config, intermediate_size: Optional[int] = None) -> None:
        super().__init__()
        size = intermediate_size or config.intermediate_size
        self.fc_1 = nn.Linear(config.n_embd, size, bias=config.bias)
        self.fc_2 = nn.Linear(config.n_embd, size, bias=config.bias)
        self.proj = nn.Linear(size, config.n_embd, bias=config.bias)
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.gate(self.fc_1(x), self.fc_2(x)))

    def gate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu(self.config, gate, up)


def swiglu(config: Config, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU of `config`: silu(gate) * up, or gpt-oss's clamped form with swiglu_alpha and swiglu_limit."""
    if config.swiglu_limit is None:
        return GatedProduct.apply(gate, up, "silu")
    return GatedProduct.apply(gate, up, "clamped_swiglu", config.swiglu_alpha, config.swiglu_limit)


class GemmaMLP(LLaMAMLP):
    """GeGLU: the SwiGLU layout with GELU as the gate."""

    def gate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return GatedProduct.apply(gate, up, "gelu_" + self.config.gelu_approximate)


class GatedProduct(torch.autograd.Function):
    """activation(gate) * up, keeping only `gate` and `up` for the backward pass, which recomputes the activation
    (autograd would also keep activation(gate): one more tensor of the MLP's width per block). `kind` is "silu",
    "gelu_none", "gelu_tanh" or "clamped_swiglu" (gpt-oss, with `alpha` and `limit`); the forward pass is torch's own
    functions, the derivative is written out."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, kind: str, alpha=None, limit=None) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.kind, ctx.alpha, ctx.limit = kind, alpha, limit
        if kind == "clamped_swiglu":
            g = gate.clamp(max=limit)
            return g * torch.sigmoid(g * alpha) * (up.clamp(-limit, limit) + 1)
        return _activation(gate, kind) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        if ctx.kind == "clamped_swiglu":
            return (*_clamped_swiglu_grads(grad, gate, up, ctx.alpha, ctx.limit), None, None, None)
        # grad_up as autograd computes it; the slope in the tensors' own dtype, so the backward pass allocates no
        # more than autograd's would (float32 temporaries of the MLP's width would outweigh what was saved).
        grad_up = grad * _activation(gate, ctx.kind)
        grad_gate = (grad * up).mul_(_activation_slope(gate, ctx.kind))
        return grad_gate, grad_up, None, None, None


def _clamped_swiglu_grads(grad, gate, up, alpha: float, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of gpt-oss's clamped SwiGLU; a clamp passes the gradient inside its bounds, ends included (torch's
    convention)."""
    g = gate.clamp(max=limit)
    s = torch.sigmoid(g * alpha)
    u = up.clamp(-limit, limit)
    grad_up = (grad * g * s).masked_fill_((up < -limit) | (up > limit), 0)
    # d/dg of g * sigmoid(alpha * g) = s * (1 + alpha * g * (1 - s))
    slope = (1 - s).mul_(g).mul_(alpha).add_(1).mul_(s)
    grad_gate = (grad * (u + 1)).mul_(slope).masked_fill_(gate > limit, 0)
    return grad_gate, grad_up


def _activation_slope(x: torch.Tensor, kind: str) -> torch.Tensor:
    """d activation(x) / dx."""
    if kind == "silu":
        sigmoid = torch.sigmoid(x)
        return (1 - sigmoid).mul_(x).add_(1).mul_(sigmoid)  # s * (1 + x * (1 - s))
    if kind == "gelu_tanh":
        c = math.sqrt(2 / math.pi)
        tanh = torch.tanh(x.pow(3).mul_(0.044715).add_(x).mul_(c))
        # 0.5 * (1 + t) + 0.5 * x * (1 - t^2) * c * (1 + 3 * 0.044715 * x^2)
        inner = x.pow(2).mul_(3 * 0.044715 * c).add_(c).mul_(x).mul_(1 - tanh.pow(2))
        return inner.add_(tanh).add_(1).mul_(0.5)
    cdf = torch.erf(x / math.sqrt(2)).add_(1).mul_(0.5)
    return x.pow(2).mul_(-0.5).exp_().mul_(x).div_(math.sqrt(2 * math.pi)).add_(cdf)


def _activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "silu":
        return F.silu(x)
    return F.gelu(x, approximate=kind.removeprefix("gelu_"))


class LLaMAMoE(nn.Module):
    """Sparse mixture of SwiGLU experts: each token goes to its top-k experts, weighted by the router (`route`:
    Mixtral's softmax, or DeepSeek-V3's sigmoid with a correction bias and group-limited choice), plus, with
    moe_n_shared_expert, the shared experts' MLP that every token goes through.

    The (token, slot) pairs are sorted by expert so that each expert's rows are contiguous, and every expert linear
    layer runs as one grouped matrix multiplication over all experts (`_ExpertsLinear`). Shapes never depend on the
    routing and nothing is read back to the host, so the forward pass does not wait for the device and
    `torch.compile` sees static shapes (quantized experts excepted: they run as modules, after one read of the counts
    per layer); biased experts add each row's expert's bias. The parameters stay one `LLaMAMLP` per expert and `gate`
    a `Router` (an `nn.Linear`) whose output is the router logits: the state-dict layout of checkpoints, conversion
    and LoRA is unchanged.
    """

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.gate = Router(config)
        self.experts = nn.ModuleList(
            LLaMAMLP(config, intermediate_size=config.moe_intermediate_size) for _ in range(config.n_expert)
        )
        # DeepSeek's shared experts: one MLP every token goes through, added to the routed experts' output.
        self.shared_experts = (
            LLaMAMLP(config, intermediate_size=config.moe_shared_intermediate_size)
            if config.moe_n_shared_expert else None
        )
        self.config = config
        # What the load-balancing loss needs from the latest forward pass (`GPT.router_aux_loss`).
        self.router_stats: Optional[RouterStats] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        k = self.config.n_expert_per_token
        x = x.reshape(-1, C)
        weights, chosen, scores = self.route(x)
        dtype = _compute_dtype(x)
        route = Routing.sort(chosen, self.config.n_expert, self._kernel(x, dtype))
        if self.config.router_aux_loss_coef:
            # Computed in every run of the block, so that a recomputation saves what the first forward saved.
            probabilities = self.probabilities(scores)
            if self.router_stats is None:
                # GPT.forward clears this; recording only once keeps the first forward's tensors (those in the
                # loss' graph) when activation checkpointing runs the block again in the backward pass.
                self.router_stats = RouterStats(route.counts(), probabilities.sum(dim=0), x.size(0))
        rows = x.index_select(0, route.token)
        if route.kernel == "modules":
            y = self._expert_modules(rows, route)
        elif dtype == x.dtype:
            y = route.from_layout(self._experts(route.to_layout(rows), route))
        else:  # autocast: the experts run in its dtype, cast here once (it does not know torch._grouped_mm)
            with torch.autocast(x.device.type, enabled=False):
                y = route.from_layout(self._experts(route.to_layout(rows.to(dtype)), route))
        # Back to (token, slot) order; every token has exactly k slots, so the weighted sum is a reshape.
        y = y.index_select(0, route.inverse).view(-1, k, C)
        y = (y * weights.to(y.dtype).unsqueeze(-1)).sum(dim=1, dtype=x.dtype)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.view(B, T, C)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights, experts), each (tokens, n_expert_per_token), and the scores of every expert (tokens, n_expert),
        all float32.

        Softmax routers (Mixtral, Qwen3-MoE, DeepSeek-V2) weight the chosen experts by their probabilities; sigmoid
        routers (DeepSeek-V3, GLM-4.5) by their scores, each expert's on its own. The correction bias and the group
        limit change only which experts are chosen, never their weights; the weights are then renormalized
        (moe_renormalize) and scaled (moe_routed_scaling), as transformers' DeepseekV3 does.
        """
        return self.route_logits(self.gate(x))

    def route_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`route` from the router's logits (tokens, n_expert), as `litgpt compress_moe` reads them."""
        c = self.config
        if c.moe_score_function == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        else:
            scores = logits.float().sigmoid()
        with torch.no_grad():  # which experts: no gradient flows through the choice, autograd keeps none of it
            bias = self.gate.e_score_correction_bias
            choice = scores if bias is None else scores + bias
            if c.moe_n_group > 1:
                choice = self._limit_to_groups(choice)
            chosen = choice.topk(c.n_expert_per_token, dim=-1).indices
        weights = scores.gather(1, chosen)
        if c.moe_renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if c.moe_routed_scaling != 1.0:
            weights = weights * c.moe_routed_scaling
        return weights, chosen, scores

    def probabilities(self, scores: torch.Tensor) -> torch.Tensor:
        """The router's distribution over the experts that the load-balancing loss reads: the softmax itself, or
        each token's sigmoid scores divided by their sum (so that P_e sums to one, as in Switch Transformer's loss)."""
        if self.config.moe_score_function == "softmax":
            return scores
        return scores / scores.sum(dim=-1, keepdim=True)

    def _limit_to_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """The scores of the experts outside each token's moe_topk_group best groups set to -inf."""
        c = self.config
        grouped = choice.view(-1, c.moe_n_group, c.n_expert // c.moe_n_group)
        if c.moe_group_score == "top2_sum":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        best = group_scores.topk(c.moe_topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)

    def _kernel(self, x: torch.Tensor, dtype: torch.dtype) -> str:
        """How the experts run, decided once per forward pass: "grouped" (torch._grouped_mm), "blocks" (one bmm over
        blocks of rows padded per expert, where the device or dtype has no grouped kernel) or "modules" (each expert
        module on its own rows, for quantized linear layers, which only run as modules)."""
        first = self.experts[0]
        linears = (first.fc_1, first.fc_2, first.proj)
        if any(not _plain_weight(linear.weight) for linear in linears):
            return "modules"
        sizes = [self.config.n_embd, self.config.moe_intermediate_size]
        if _lora(first.fc_1):
            sizes.append(first.fc_1.r)  # the adapters' rows of r elements
        return "grouped" if _grouped_mm_supported(x.device, dtype, sizes) else "blocks"

    def _experts(self, x: torch.Tensor, route: "Routing") -> torch.Tensor:
        """The SwiGLU experts on the rows of `x` laid out by expert; fc_1 and fc_2 run as one multiplication."""
        gate, up = self._linear(x, route, "fc_1", "fc_2")
        return self._linear(swiglu(self.config, gate, up), route, "proj")[0]

    def _expert_modules(self, x: torch.Tensor, route: "Routing") -> torch.Tensor:
        # The one host read of this layer: a module takes a tensor of its own rows, whose size the host must know.
        chunks = x.split(route.counts().long().tolist())
        return torch.cat([expert(chunk) for expert, chunk in zip(self.experts, chunks)])

    def _linear(self, x: torch.Tensor, route: "Routing", *names: str) -> list[torch.Tensor]:
        """Every expert's linear layer `name` (several names: their outputs side by side in one multiplication)."""
        layers = [[getattr(expert, name) for expert in self.experts] for name in names]
        weights = [layer.weight.to(x.dtype) for per_expert in zip(*layers) for layer in per_expert]
        out = _ExpertsLinear.apply(x, route.groups, route.kernel, len(names), *weights)
        outs = list(out.split([per_name[0].out_features for per_name in layers], dim=-1))
        for i, per_name in enumerate(layers):
            if _lora(per_name[0]):
                outs[i] = outs[i] + self._lora_update(x, route, per_name)
            if per_name[0].bias is not None:  # each row gets its own expert's bias
                bias = torch.stack([layer.bias for layer in per_name]).to(x.dtype)
                outs[i] = outs[i] + bias.index_select(0, route.experts)
        return outs

    @staticmethod
    def _lora_update(x: torch.Tensor, route: "Routing", layers: list) -> torch.Tensor:
        """LoRA's scaling * dropout(x) A^T B^T with each row's own expert's factors (`litgpt.lora.LoRALinear`)."""
        first = layers[0]
        a = [layer.lora_A.to(x.dtype) for layer in layers]
        b = [layer.lora_B.to(x.dtype) for layer in layers]
        low = _ExpertsLinear.apply(first.lora_dropout(x), route.groups, route.kernel, 1, *a) * first.scaling
        return _ExpertsLinear.apply(low, route.groups, route.kernel, 1, *b)


class Router(nn.Linear):
    """A mixture of experts' router: `weight` (n_expert, n_embd) gives the logits, in float32 for sigmoid routers as
    DeepSeek-V3 and GLM-4.5 compute them (their checkpoints keep the router in float32), in the model's dtype for
    softmax ones (Mixtral). `e_score_correction_bias` (n_expert,), with moe_expert_bias, is the buffer DeepSeek-V3
    adds to the scores to choose the experts; load balancing adjusts it outside of gradient descent, so it is a
    buffer, saved, loaded and converted with the weights, never trained."""

    def __init__(self, config: Config) -> None:
        super().__init__(config.n_embd, config.n_expert, bias=config.router_bias)
        self.float32_logits = config.moe_score_function == "sigmoid"
        self.e_score_correction_bias: Optional[torch.Tensor]
        if config.moe_expert_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.n_expert))
        else:
            self.e_score_correction_bias = None

    def _apply(self, fn, recurse: bool = True):
        """`Module.to(dtype)` (and .half(), .bfloat16()) casts the weight but keeps the correction bias in float32,
        as transformers and the published checkpoints do: the choice among experts turns on differences of a few
        thousandths, below bfloat16's resolution of the scores."""
        before = self.e_score_correction_bias
        super()._apply(fn, recurse)
        after = self.e_score_correction_bias
        if before is not None and before.dtype == torch.float32 and after.dtype != torch.float32:
            self.e_score_correction_bias = after.float() if before.is_meta != after.is_meta else before.to(after.device)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.float32_logits:
            return super().forward(x)
        autocast_off = torch.autocast(x.device.type, enabled=False) if x.device.type in ("cpu", "cuda") else None
        with autocast_off or contextlib.nullcontext():
            return F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())


class RouterStats(NamedTuple):
    """One MoE layer's routing in one forward pass: top-k assignments per expert (float, no gradient), the router
    probabilities summed over the tokens per expert (in the autograd graph), and the number of tokens."""

    counts: torch.Tensor
    prob_sum: torch.Tensor
    rows: int


class Routing:
    """Where each (token, slot) pair goes, computed on the device from the chosen experts alone.

    `token[i]` is the token of the i-th row sorted by expert (a stable sort, so each expert's rows stay in token
    order), `ends[e]` the end of expert e's rows, `inverse` the sorted row of each (token, slot) pair and `experts`
    the expert of each of the kernel's rows. `groups` tells the kernel which rows are whose: the int32 `ends` for
    "grouped", the expert of each block for "blocks".
    """

    def __init__(self, kernel: str) -> None:
        self.kernel = kernel
        self.block_size = 0
        self.padded_rows: Optional[torch.Tensor] = None  # "blocks": each sorted row's place among the padded rows

    @classmethod
    def sort(cls, chosen: torch.Tensor, n_expert: int, kernel: str) -> "Routing":
        route = cls(kernel)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        sorted_experts = flat.index_select(0, order)
        route.token = order.div(chosen.size(1), rounding_mode="floor")
        route.ends = torch.searchsorted(sorted_experts, torch.arange(n_expert, device=flat.device), right=True)
        route.inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        route.groups = route.ends.to(torch.int32)
        route.experts = sorted_experts
        if kernel == "blocks":
            route._pad_to_blocks(sorted_experts)
        return route

    def counts(self) -> torch.Tensor:
        """Rows per expert, as float."""
        return torch.diff(self.ends, prepend=self.ends.new_zeros(1)).float()

    def _pad_to_blocks(self, sorted_experts: torch.Tensor) -> None:
        """Give each expert whole blocks of `block_size` rows (zero rows fill its last one), so that every block
        belongs to one expert and all experts run as one bmm. The number of blocks is the bound over all routings,
        (rows + n_expert * (block_size - 1)) / block_size, so shapes stay static; a block size of at least the mean
        rows per expert keeps it at most about twice the number of experts."""
        n_expert, rows = self.ends.numel(), sorted_experts.numel()
        size = self.block_size = max(16, 1 << (max(1, -(-rows // n_expert)) - 1).bit_length())
        counts = self.counts().long()
        padded_counts = (counts + size - 1) // size * size
        padded_ends = padded_counts.cumsum(0)
        shift = (padded_ends - padded_counts) - (self.ends - counts)  # padded start - sorted start, per expert
        self.padded_rows = torch.arange(rows, device=sorted_experts.device) + shift.index_select(0, sorted_experts)
        starts = torch.arange(-(-(rows + n_expert * (size - 1)) // size), device=sorted_experts.device) * size
        self.groups = torch.searchsorted(padded_ends, starts, right=True).clamp_(max=n_expert - 1)
        self.experts = self.groups.repeat_interleave(size)  # the expert of each padded row

    def to_layout(self, x: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert -> the kernel's rows (zero-padded blocks for "blocks")."""
        if self.kernel != "blocks":
            return x
        return x.new_zeros(self.groups.numel() * self.block_size, x.size(1)).index_copy(0, self.padded_rows, x)

    def from_layout(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.kernel != "blocks" else y.index_select(0, self.padded_rows)


class _ExpertsLinear(torch.autograd.Function):
    """x @ W_e^T for the rows of each expert e, W_e being the expert's `n_parts` weights (out, in) stacked along
    their rows. The experts' weights are stacked for the multiplication in the forward pass and again in the backward
    pass: autograd would otherwise save the stacked copy, one more copy of every expert's weights per layer kept
    until the backward pass, where this saves only the parameters themselves (alive anyway; under FSDP2 the block's
    unsharded ones, gathered again for the backward pass) and the small routing tensors. Measured on the layer of
    benchmarks/moe.py (64 experts, 4096 tokens, float32): 370 MiB kept instead of 562; the price is a second copy
    of the weights in the backward pass (8% of the layer's step on the CPU)."""

    @staticmethod
    def forward(ctx, x, groups, kernel: str, n_parts: int, *weights):
        ctx.save_for_backward(x, groups, *weights)
        ctx.kernel, ctx.n_parts = kernel, n_parts
        return _experts_mm(x, _stack(weights, n_parts).transpose(1, 2), groups, kernel)

    @staticmethod
    def backward(ctx, grad):
        x, groups, *weights = ctx.saved_tensors
        grad = grad.contiguous()  # an expanded gradient (stride 0) is no valid operand of a grouped matmul
        stacked = _stack(weights, ctx.n_parts)
        grad_x = _experts_mm(grad, stacked, groups, ctx.kernel) if ctx.needs_input_grad[0] else None
        grad_weights = [None] * len(weights)
        if any(ctx.needs_input_grad[4:]):
            grad_stacked = _experts_weight_grad(grad, x, groups, ctx.kernel, stacked.size(0))
            sizes = [w.size(0) for w in weights[: ctx.n_parts]]
            grad_weights = [part for expert in grad_stacked for part in expert.split(sizes)]
        return grad_x, None, None, None, *grad_weights


def _stack(weights, n_parts: int) -> torch.Tensor:
    """(n_expert, sum of the parts' rows, in) from the experts' weights listed expert by expert, in one copy."""
    if all(w.shape == weights[0].shape for w in weights[:n_parts]):
        stacked = torch.stack(weights)
        return stacked.view(-1, n_parts * stacked.size(1), stacked.size(2))
    return torch.stack([torch.cat(weights[i : i + n_parts]) for i in range(0, len(weights), n_parts)])


def _experts_mm(x: torch.Tensor, w: torch.Tensor, groups: torch.Tensor, kernel: str) -> torch.Tensor:
    """x (rows, in) @ w[e] (in, out) for each expert's rows."""
    if kernel == "grouped":
        return _grouped_mm(x, w, groups)
    blocks = x.view(groups.numel(), -1, x.size(1))
    return torch.bmm(blocks, w.index_select(0, groups)).view(x.size(0), w.size(2))


def _experts_weight_grad(grad, x, groups, kernel: str, n_expert: int) -> torch.Tensor:
    """sum over each expert's rows of grad^T x: (n_expert, out, in)."""
    if kernel == "grouped":
        return _grouped_mm(grad.t(), x, groups)
    n_blocks = groups.numel()
    per_block = torch.bmm(grad.view(n_blocks, -1, grad.size(1)).transpose(1, 2), x.view(n_blocks, -1, x.size(1)))
    return per_block.new_zeros(n_expert, *per_block.shape[1:]).index_add_(0, groups, per_block)


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm(a, b, offs=offs): (rows, in) x (groups, in, out) -> (rows, out), or (out, rows) x (rows, in)
    -> (groups, out, in). torch's meta kernel (fake tensors, torch.compile) takes bf16 alone where its CPU kernel
    also runs 16- and 32-bit floats: those go through an op of our own that knows the shapes."""
    if a.dtype == torch.bfloat16:
        return torch._grouped_mm(a, b, offs=offs)
    return _grouped_mm_op(a, b, offs)


@torch.library.custom_op("litgpt::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)


@_grouped_mm_op.register_fake
def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.size(0), b.size(2))
    return a.new_empty(offs.size(0), a.size(0), b.size(1))


def _plain_weight(weight: Optional[torch.Tensor]) -> bool:
    """A weight the grouped kernels can read: floating point and not quantized (bitsandbytes keeps integers, or no
    `weight` under LoRA; torchao's NF4 is a tensor subclass that only runs as F.linear)."""
    from litgpt.quantize import is_nf4

    return weight is not None and weight.is_floating_point() and not is_nf4(weight)


def _lora(linear: nn.Module) -> bool:
    """Whether an expert linear layer carries LoRA factors not merged into its weight (`litgpt.lora.LoRALinear`)."""
    return hasattr(linear, "lora_A") and not linear.merged


def _grouped_mm_supported(device: torch.device, dtype: torch.dtype, sizes: list[int]) -> bool:
    """Whether torch._grouped_mm runs these matrices without a host sync: on the CPU for 16- and 32-bit floats, on
    CUDA through its CUTLASS kernel, bf16 on sm90/sm100 (elsewhere it falls back to a loop that reads the group ends
    back to the host). Every row it reads must start on a 16-byte boundary."""
    if device.type == "cpu":
        dtypes = (torch.float32, torch.bfloat16, torch.float16)
    elif device.type == "cuda" and torch.cuda.is_available():
        dtypes = (torch.bfloat16,) if torch.cuda.get_device_capability(device)[0] in (9, 10) else ()
    else:
        dtypes = ()
    return dtype in dtypes and all(size * dtype.itemsize % 16 == 0 for size in sizes)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's when it is on, else x's."""
    device = x.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def build_mlp(config: Config, layer_idx: Optional[int] = None) -> nn.Module:
    """The MLP of layer `layer_idx`: the config's class, or the dense LLaMAMLP in the first moe_first_dense_layers
    layers of a mixture of experts (None: the config's class)."""
    if layer_idx is not None and config.mlp_class_name == "LLaMAMoE" and not config.is_moe_layer(layer_idx):
        return LLaMAMLP(config)
    return {"GptNeoxMLP": GptNeoxMLP, "LLaMAMLP": LLaMAMLP, "GemmaMLP": GemmaMLP, "LLaMAMoE": LLaMAMoE}[
        config.mlp_class_name
    ](config)
