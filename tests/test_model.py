"""Model behaviour that the conversion tests do not reach: meta-device init, rope scaling, masks."""

from __future__ import annotations

import pytest
import torch

from litgpt.config import Config
from litgpt.model import GPT, attention_mask, rope_frequencies

SMALL = dict(n_layer=2, n_embd=64, n_head=4, n_query_groups=2, vocab_size=100, block_size=32, padding_multiple=64)


def test_padded_vocab_and_defaults():
    config = Config(**SMALL)
    assert config.padded_vocab_size == 128 and config.head_size == 16 and config.intermediate_size == 256
    assert config.qkv_size == (4 + 2 * 2) * 16


def test_meta_init_equals_eager_init():
    """A model built on the meta device and materialized equals one built in place from the same seed."""
    config = Config(**SMALL, tie_embeddings=True)
    eager = GPT(config)
    torch.manual_seed(7)
    eager.init_weights()
    with torch.device("meta"):
        lazy = GPT(config)
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    assert lazy.lm_head.weight is lazy.transformer.wte.weight
    torch.manual_seed(7)
    lazy.init_weights()
    for (name, a), b in zip(eager.state_dict().items(), lazy.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    tokens = torch.randint(0, 100, (1, 8))
    torch.testing.assert_close(eager(tokens), lazy(tokens))


def test_init_statistics():
    config = Config(**SMALL)
    model = GPT(config)
    model.init_weights()
    assert abs(model.transformer.wte.weight.std().item() - 0.02) < 0.002
    residual = model.transformer.h[0].attn.proj.weight.std().item()
    assert abs(residual - 0.02 / (2 * config.n_layer) ** 0.5) < 0.002
    assert torch.all(model.transformer.h[0].norm_1.weight == 1)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5},
    ],
)
def test_rope_frequencies_equal_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = LlamaConfig(
        hidden_size=256, num_attention_heads=2, max_position_embeddings=512, rope_parameters={**scaling, "rope_theta": 10000.0}
    )
    expected, expected_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, "cpu")
    ours = {("type" if k == "rope_type" else k): v for k, v in scaling.items()}
    inv_freq, factor = rope_frequencies(128, 10000.0, ours)
    torch.testing.assert_close(inv_freq, expected.float())
    assert factor == pytest.approx(expected_factor)


def test_sliding_window_mask_by_hand():
    mask = attention_mask(5, 5, None, window=2, device="cpu")
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(mask, expected)
    # Decoding position 4 with a cache of 5 keys.
    assert torch.equal(attention_mask(1, 5, torch.tensor([4]), None, "cpu"), torch.ones(1, 5, dtype=torch.bool))
    assert attention_mask(5, 5, None, None, "cpu") is None


def test_softcapping_with_large_cap_equals_plain_attention():
    """The manual attention path (used for soft-capping) agrees with SDPA when the cap is too large to bite."""
    torch.manual_seed(0)
    plain = GPT(Config(**SMALL, sliding_window_size=3))
    plain.init_weights()
    capped = GPT(Config(**SMALL, sliding_window_size=3, attention_logit_softcapping=1e6))
    capped.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 100, (2, 12))
    torch.testing.assert_close(plain(tokens), capped(tokens), atol=1e-5, rtol=1e-5)


def test_sequence_longer_than_block_size():
    model = GPT(Config(**SMALL))
    with pytest.raises(ValueError, match="exceeds the model's block size"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_moe_routes_to_top_k_experts():
    """With one expert per token and an identity-free router, a token's output is exactly its chosen expert's."""
    torch.manual_seed(0)
    config = Config(**SMALL, mlp_class_name="LLaMAMoE", n_expert=3, n_expert_per_token=1, intermediate_size=32)
    model = GPT(config)
    model.init_weights()
    moe = model.transformer.h[0].mlp
    x = torch.randn(1, 5, 64)
    chosen = moe.gate(x[0]).argmax(dim=-1)
    expected = torch.stack([moe.experts[int(e)](x[0, i]) for i, e in enumerate(chosen)])
    torch.testing.assert_close(moe(x)[0], expected)
