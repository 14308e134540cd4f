"""The GPT model, top to bottom, single-device PyTorch: `GPT`, its `Block`s, attention, norms and the KV cache.

Everything an architecture family needs is a field of `Config`; nothing here knows about model names or about
parallelism. Parameters may be created on the `meta` device and materialized later with `init_weights`. The rotary
tables live in `litgpt.rope`, the dense MLPs in `litgpt.mlp` and the mixture-of-experts layers in `litgpt.moe`.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from litgpt.config import Config
from litgpt.mlp import GemmaMLP, GptNeoxMLP, LLaMAMLP
from litgpt.moe import LLaMAMoE, Router, load_balancing_loss
from litgpt.precision import compute_dtype, cpu_has_fast_bf16
from litgpt.rope import apply_rope, apply_rope_interleaved, build_rope_cache


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
            which = (self.longest_position(positions) >= original).long().expand_as(positions)
            cos, sin = cos[which, positions], sin[which, positions]
        else:
            cos, sin = cos[positions], sin[positions]
        if positions.dim() == 2:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return cos, sin

    def longest_position(self, positions: torch.Tensor) -> torch.Tensor:
        """The longest position of the pass (`positions` (T,)) or of each row ((B, T)), shaped (1,) or (B, 1): what
        LongRoPE's choice of factors reads. A pass over a slice of each sequence (context parallelism) is told the
        whole sequence's instead."""
        return positions.amax(dim=-1, keepdim=True)

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
            kv_length = cache.length

        for block in self.transformer.h:
            if isinstance(block.mlp, LLaMAMoE):
                block.mlp.router_stats = None  # each MoE layer records this pass' routing (router_aux_loss)

        x = self.embed(idx)
        layer_inputs = self.layer_inputs(x, T, kv_length, positions, sample_positions)
        for i, block in enumerate(self.transformer.h):
            x = block(x, *layer_inputs[i], positions)

        x = self.transformer.ln_f(x)
        return x if return_hidden else self.head(x)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """The token embeddings of `idx` (B, T), scaled where the family scales them: the first block's input."""
        x = self.transformer.wte(idx)
        if self.config.scale_embeddings:
            x = x * torch.tensor(self.config.n_embd**0.5, dtype=x.dtype)
        return x

    def layer_inputs(
        self, x: torch.Tensor, T: int, kv_length: int, positions: Optional[torch.Tensor] = None,
        sample_positions: Optional[torch.Tensor] = None,
    ) -> list[tuple[Optional[tuple[torch.Tensor, torch.Tensor]], Optional[torch.Tensor]]]:
        """What layer i reads beside the residual stream `x` of T positions (its device and dtype; a layer split over
        the sequence from outside holds fewer), for every layer of the config: its rotary (cos, sin) (None for a layer
        without rotary embedding) and its attention mask, each kind built once."""
        c = self.config
        ropes = {}
        for local in {c.rope_local_base is not None and c.is_sliding_layer(i) for i in range(c.n_layer)}:
            # packed samples (sample_positions) rotate by their own positions
            cos, sin = self.rope_at(x.device, local, T, positions if sample_positions is None else sample_positions)
            ropes[local] = (cos.to(x.dtype), sin.to(x.dtype))

        masks = {}
        for window in {c.sliding_window_size if c.is_sliding_layer(i) else None for i in range(c.n_layer)}:
            masks[window] = attention_mask(T, kv_length, positions, window, x.device, sample_positions)

        inputs = []
        for i in range(c.n_layer):
            sliding = c.is_sliding_layer(i)
            rope = ropes[c.rope_local_base is not None and sliding] if c.uses_rope(i) else None
            inputs.append((rope, masks[c.sliding_window_size if sliding else None]))
        return inputs

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the final norm's output (`forward(..., return_hidden=True)`), soft-capped where the family does."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def router_aux_loss(self) -> Optional[torch.Tensor]:
        """The load-balancing loss of the latest forward pass over every MoE layer together
        (`litgpt.moe.load_balancing_loss`), in the autograd graph; None without MoE layers or with a coefficient of 0.
        """
        layers = [block.mlp for block in self.transformer.h if isinstance(block.mlp, LLaMAMoE)]
        if not layers or not self.config.router_aux_loss_coef:
            return None
        stats = [layer.router_stats for layer in layers]
        if any(s is None for s in stats):
            raise RuntimeError("router_aux_loss() reads the routing of a forward pass: call the model first.")
        return load_balancing_loss(self.config, stats)

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


def numbered_blocks(blocks: nn.ModuleList) -> Iterator[tuple[int, nn.Module]]:
    """(layer index, block) of `blocks`: a GPT's, or some of them kept under their own names (a pipeline stage's)."""
    return ((int(name), block) for name, block in blocks.named_children())


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
        # The heads this layer computes: the config's, or under tensor parallelism this rank's share of them.
        self.n_head, self.n_query_groups = config.n_head, config.n_query_groups
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
        return KVCache(batch_size, self.n_query_groups, max_seq_length, self.config.head_size, device=device,
                       dtype=dtype)

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
        nh, ng = self.n_head, self.n_query_groups
        q, k, v = qkv.split((nh * c.head_size, ng * c.head_size, ng * c.head_size), dim=-1)
        if input_pos is None and torch.is_grad_enabled() and not c.norm_qk and c.clip_qkv is None:
            # Attention saves q, k and v for the backward pass: a view of the fused projection's output would keep all
            # of it alive (6x the values with Llama 3's 4:1 grouped queries). RoPE makes new q and k. (Norms of q and
            # k, and the clamp, save the whole output anyway.)
            v = v.contiguous()
            if rope is None:
                q, k = q.contiguous(), k.contiguous()
        whole_qk_norm = c.norm_qk and c.norm_qk_type == "olmo2"
        if whole_qk_norm:
            q, k = self.norm_q(q), self.norm_k(k)
        q = q.view(B, T, nh, c.head_size).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, ng, c.head_size).transpose(1, 2)  # (B, ng, T, hs)
        v = v.view(B, T, ng, c.head_size).transpose(1, 2)
        if c.norm_qk and not whole_qk_norm:
            q, k = self.norm_q(q), self.norm_k(k)
        if rope is not None:
            cos, sin = rope
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)

        if input_pos is not None:
            k, v = self.kv_cache.update(input_pos, k, v)

        y = self.attend(q, k, v, mask)
        y = y.transpose(1, 2).reshape(B, T, nh * c.head_size)
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
            q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.n_query_groups != self.n_head
        )
        return y[..., :hs]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        c = self.config
        if c.attention_sinks and c.attention_logit_softcapping is None:
            return self.attend_with_sink_key(q, k, v, mask)
        if c.attention_logit_softcapping is None:
            if mask is None and takes_matmul_attention(q, k):
                return causal_attention_by_matmuls(q, k, v, self.scale)
            # mask None means plain causal attention over the whole sequence.
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                enable_gqa=self.n_query_groups != self.n_head,
            )
        # Soft-capping squashes the scores before the softmax, which SDPA cannot express.
        if self.n_query_groups != self.n_head:
            repeats = self.n_head // self.n_query_groups
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


class MatmulAttention:
    """Up to how many positions plain causal attention on a CPU runs as `causal_attention_by_matmuls`, in float32 on
    any CPU and in bfloat16 on CPUs with native bf16 (AVX512-BF16 or AMX): SDPA's fused CPU kernel takes longer for
    short sequences. Forward + backward of a layer on a 2-core EPYC, compiled as training compiles it: a 5M Llama's 4
    heads in 2 groups x 256 positions, float32 4.3 against 6.1 ms, bf16 2.3 against 5.7 ms; 512 positions in float32,
    13.5 against 21 ms. From 1024 positions the fused kernel is as fast and the kept weights grow large, so it keeps
    them. `max_positions` 0 turns it off (`litgpt plan` does for other devices). Queries go in blocks of
    `query_block` positions, each against the keys up to its last position only."""

    max_positions = 512
    query_block = 64
    bf16 = cpu_has_fast_bf16()  # read once: the model's forward must not read /proc/cpuinfo (nor break a graph)

    @classmethod
    def multiplies(cls, dtype: torch.dtype) -> bool:
        """Whether the CPU multiplies `dtype` fast enough for it: float32 always, bf16 where it is native."""
        return dtype == torch.float32 or (dtype == torch.bfloat16 and cls.bf16)


def takes_matmul_attention(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether plain causal attention of these queries and keys runs as `causal_attention_by_matmuls`."""
    T = q.size(-2)
    short = T == k.size(-2) <= MatmulAttention.max_positions
    return q.device.type == "cpu" and MatmulAttention.multiplies(compute_dtype(q)) and short


def causal_attention_by_matmuls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of queries (B, nh, T, hs) to keys and values (B, ng, T, hs) as matmuls per key group for the
    scores, a float32 softmax and matmuls for the values, as transformers' eager attention computes it (the scores
    rounded to the compute dtype). The query heads of a group (`nh // ng`, consecutive, as SDPA's `enable_gqa` pairs
    them) are stacked along the positions, so their keys and values are never repeated. Each block of
    `MatmulAttention.query_block` query positions meets only the keys up to its last position: the blocks above the
    diagonal, masked out anyway, are never computed (37 % of the work at 256 positions)."""
    B, nh, T, hs = q.shape
    ng = k.size(1)
    per_group = nh // ng
    q = q.view(B, ng, per_group, T, hs)
    outputs = []
    for start in range(0, T, MatmulAttention.query_block):
        end = min(start + MatmulAttention.query_block, T)
        rows = q[:, :, :, start:end].reshape(B, ng, per_group * (end - start), hs)
        scores = (rows @ k[:, :, :end].transpose(-2, -1)) * scale
        causal = torch.ones(end - start, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
        scores = scores.masked_fill(~causal.repeat(per_group, 1), float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
        outputs.append((weights.to(v.dtype) @ v[:, :, :end]).view(B, ng, per_group, end - start, hs))
    return torch.cat(outputs, dim=3).view(B, nh, T, hs)


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

    @property
    def length(self) -> int:
        """The positions a query may attend to: the width of the attention mask."""
        return self.k.size(2)

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
        # The heads this layer computes: the config's, or under tensor parallelism this rank's share of them.
        self.n_head = c.n_head
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
        return KVCache(batch_size, self.n_head, max_seq_length, c.head_size, device, dtype, c.v_head_dim)

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
        q_nope, q_rope = q.view(B, T, self.n_head, c.head_size).transpose(1, 2).split(
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
                return self.proj(y.transpose(1, 2).reshape(B, T, self.n_head * c.v_head_dim))
        k, v = self.expand(latent, k_rope)
        if cache is not None and not cache.latent:
            k, v = cache.update(input_pos, k, v)

        y = self.attend(torch.cat((q_nope, q_rope), dim=-1), k, v, mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, self.n_head * c.v_head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Every head's attention of q (B, nh, T, head_size) to its expanded keys and values (mask None: causal)."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale)

    def attend_latent(self, q_nope, q_rope, latent, k_rope, mask) -> torch.Tensor:
        """Attention over the cached latents themselves, without expanding them (one decoded token): kv_b_proj's
        key rows are folded into the query and its value rows applied after the attention, so a step costs
        O(cache length * kv_lora_rank) per head instead of expanding every cached position. The same products in
        another order: equal up to rounding. Returns (B, nh, T, v_head_dim)."""
        c = self.config
        w = self.kv_b_proj.weight.view(self.n_head, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        w_k, w_v = w.split((c.qk_nope_head_dim, c.v_head_dim), dim=1)
        q = torch.cat((q_nope @ w_k, q_rope), dim=-1)  # (B, nh, T, kv_lora_rank + qk_rope_head_dim)
        k = torch.cat((latent, k_rope), dim=-1).expand(-1, self.n_head, -1, -1)
        v = latent.expand(-1, self.n_head, -1, -1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return y @ w_v.transpose(1, 2)

    def expand(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head's key (B, nh, S, head_size) and value (B, nh, S, v_head_dim) from the latent (B, 1, S, r) and
        the shared rotary key (B, 1, S, qk_rope_head_dim)."""
        c = self.config
        B, _, S, _ = latent.shape
        kv = self.kv_b_proj(latent).view(B, S, self.n_head, c.qk_nope_head_dim + c.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split((c.qk_nope_head_dim, c.v_head_dim), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, self.n_head, -1, -1)), dim=-1)
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
        return normed * self.weight.view(-1, 1, self.head_size)  # x's heads: the weight holds as many

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


# ---- MLPs ------------------------------------------------------------------------------------------------------------------
def build_mlp(config: Config, layer_idx: Optional[int] = None) -> nn.Module:
    """The MLP of layer `layer_idx`: the config's class, or the dense LLaMAMLP in the first moe_first_dense_layers
    layers of a mixture of experts (None: the config's class)."""
    if layer_idx is not None and config.mlp_class_name == "LLaMAMoE" and not config.is_moe_layer(layer_idx):
        return LLaMAMLP(config)
    return {"GptNeoxMLP": GptNeoxMLP, "LLaMAMLP": LLaMAMLP, "GemmaMLP": GemmaMLP, "LLaMAMoE": LLaMAMoE}[
        config.mlp_class_name
    ](config)
