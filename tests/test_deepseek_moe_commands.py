"""Every command on a tiny GLM-4.5-shaped model (the DeepSeek-style mixture of experts: a dense first layer, shared
and routed experts behind a grouped sigmoid router with a correction bias): greedy generation with the KV cache
against transformers, finetune_lora with adapters on the routed and shared experts, merge_lora and the export of the
merged model, distill into it; FSDP with two processes against one is test_moe.py's check, run on this model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_models import build_hf_model

from litgpt.__main__ import main as cli_main
from litgpt.checkpoint.model_files import load_model_weights
from litgpt.config import Config
from litgpt.data.tiny import TINY_DIR, TOKENIZER_DIR
from litgpt.io import load_state_dict, save_state_dict
from litgpt.lora import LoRASettings, add_lora, load_base_weights, load_lora_weights
from litgpt.model import GPT

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 4096  # the bundled tokenizer's


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """The tiny transformers GLM-4.5 case of tests/hf_models.py with the bundled tokenizer's vocabulary, converted;
    and instruction data."""
    from litgpt.convert.hf_to_litgpt import convert_hf_checkpoint

    root = tmp_path_factory.mktemp("glm4_moe")
    hf = build_hf_model("glm4_moe", vocab_size=VOCAB, max_position_embeddings=512)
    hf.save_pretrained(root / "base")
    for file in TOKENIZER_DIR.iterdir():
        shutil.copy2(file, root / "base" / file.name)
    convert_hf_checkpoint(root / "base")
    stories = (TINY_DIR / "val.txt").read_text().split("\n\n")[:24]
    (root / "data.json").write_text(json.dumps([{"instruction": "Go on.", "output": s[:160]} for s in stories]))
    return {"root": root, "base": root / "base", "hf": hf}


def load_lit(folder: Path) -> GPT:
    model = GPT(Config.from_checkpoint(folder))
    load_model_weights(model, load_state_dict(folder / "lit_model.pth"), str(folder))
    return model.eval()


def test_greedy_generation_with_the_kv_cache_equals_transformers(world):
    from transformers import GenerationConfig

    from litgpt.generate import generate, load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(world["base"], precision="32-true", device="cpu")
    prompt = tokenizer.encode("Once upon a time, a little fox")
    ours = list(generate(model, prompt, 20, temperature=0))
    no_stop = GenerationConfig(do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        theirs = world["hf"].generate(prompt[None], attention_mask=torch.ones_like(prompt)[None],
                                      generation_config=no_stop)[0, len(prompt):].tolist()
    assert len(theirs) == 20 and ours == theirs


def test_finetune_lora_on_routed_and_shared_experts_then_merge_and_export(world, tmp_path):
    """finetune_lora through the CLI with adapters on every MLP: the dense layer's, the routed experts' and the
    shared experts' adapters all train; the merged model computes what base + adapters compute, and exports to
    transformers' Glm4MoeForCausalLM with the same logits."""
    from transformers import AutoModelForCausalLM

    from litgpt.convert.litgpt_to_hf import convert_lit_checkpoint

    out = tmp_path / "run"
    cli_main(["finetune_lora", str(world["base"]), "--lora_mlp", "true", "--lora_r", "4", "--lora_alpha", "8",
              "--data", "JSON", "--data.json_path", str(world["root"] / "data.json"), "--data.val_split_fraction",
              "0.2", "--train.max_steps", "3", "--train.global_batch_size", "2", "--train.micro_batch_size", "2",
              "--train.max_seq_length", "256", "--train.lr_warmup_steps", "1", "--eval.interval", "1000",
              "--eval.max_iters", "1", "--optimizer.class_path", "torch.optim.AdamW", "--optimizer.init_args.lr",
              "0.01", "--precision", "32-true", "--out_dir", str(out)])
    final = out / "final"
    adapters = load_state_dict(final / "lit_model.pth.lora")
    for module in ("h.0.mlp.fc_1", "h.1.mlp.experts.0.fc_1", "h.1.mlp.experts.7.proj", "h.2.mlp.shared_experts.fc_2",
                   "h.2.mlp.shared_experts.proj"):
        assert f"transformer.{module}.lora_A" in adapters, module
    trained = [key.split(".mlp.")[1].split(".")[0] for key, value in adapters.items()
               if ".mlp." in key and key.endswith("lora_B") and value.abs().sum() > 0]
    assert {"fc_1", "experts", "shared_experts"} <= set(trained)  # B starts at zero: these received gradients
    assert not any(".mlp.gate." in key for key in adapters)  # never the router

    (final / "lit_model.pth").unlink()  # finetune_lora merged already: merge_lora writes it again
    cli_main(["merge_lora", str(final)])
    adapted = GPT(Config.from_checkpoint(final))
    add_lora(adapted, LoRASettings(r=4, alpha=8, dropout=0.0, mlp=True))
    load_base_weights(adapted, load_state_dict(world["base"] / "lit_model.pth"), "base")
    load_lora_weights(adapted, adapters, source="adapters")
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    merged = load_lit(final)
    with torch.no_grad():
        assert (merged(tokens) - adapted.eval()(tokens)).abs().max() < 1e-5
        assert (merged(tokens) - load_lit(world["base"])(tokens)).abs().max() > 1e-3  # the adapters did something

    convert_lit_checkpoint(final, tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert (exported(tokens).logits - merged(tokens)).abs().max() < 1e-4


def test_distill_into_a_tiny_glm4_moe_student(world, tmp_path):
    """`litgpt distill` from the converted model into a smaller random GLM-4.5-shaped student: both losses are
    logged, the student's experts (routed and shared) and router train, its correction biases stay as they were."""
    from checkpoint_helpers import write_random_checkpoint
    from test_distill import logged, schedule

    teacher_config = Config.from_checkpoint(world["base"])
    student_config = Config(**{**teacher_config.to_dict(), "name": "glm-student", "n_layer": 2, "n_embd": 32,
                               "n_head": 2, "n_query_groups": 1, "intermediate_size": 48})
    student = write_random_checkpoint(tmp_path / "student", student_config, seed=2)
    biased = load_state_dict(student / "lit_model.pth")
    biased["transformer.h.1.mlp.gate.e_score_correction_bias"] = torch.linspace(-0.1, 0.1, 8)
    save_state_dict(biased, student / "lit_model.pth")
    texts = tmp_path / "texts"
    texts.mkdir()
    for i, story in enumerate((TINY_DIR / "train.txt").read_text().split("\n\n")[:30]):
        (texts / f"{i:03d}.txt").write_text(story)
    out = tmp_path / "out"
    cli_main(["distill", str(student), "--teacher_dir", str(world["base"]), "--out_dir", str(out), "--data",
              "TextFiles", "--data.train_data_path", str(texts), "--data.cache_dir", str(tmp_path / "cache"),
              *map(str, schedule(3, lr=0.01)), "--kd.temperature", "2.0", "--kd.alpha", "0.5"])
    rows = logged(out)
    assert len(rows) == 3 and all(row["kd_loss"] > 0 and row["ce_loss"] > 0 for row in rows)
    before, after = load_state_dict(student / "lit_model.pth"), load_state_dict(out / "final" / "lit_model.pth")
    for key in ("transformer.h.1.mlp.gate.weight", "transformer.h.1.mlp.shared_experts.proj.weight",
                "transformer.h.0.mlp.fc_1.weight"):
        assert not torch.equal(before[key], after[key]), key
    assert any(not torch.equal(before[k], after[k]) for k in before if ".mlp.experts." in k)
    bias = "transformer.h.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(after[bias], before[bias])


# ---- FSDP2: two processes equal one --------------------------------------------------------------------------------
# test_moe.py's test_fsdp2_with_checkpointing_equals_one_process checks this model, in the same launch of two ranks
# as its own Mixtral-style model: every parameter of the dense layer, the routers, the routed and the shared experts
# gets one process' gradient.
FSDP_CONFIG = dict(n_layer=3, n_embd=64, n_head=4, n_query_groups=2, vocab_size=100, padded_vocab_size=128,
                   block_size=32, intermediate_size=96, mlp_class_name="LLaMAMoE", moe_intermediate_size=32,
                   n_expert=8, n_expert_per_token=3, moe_n_shared_expert=1, moe_score_function="sigmoid",
                   moe_expert_bias=True, moe_n_group=4, moe_topk_group=2, moe_routed_scaling=2.5,
                   moe_first_dense_layers=1, router_aux_loss_coef=0.1, attn_bias=True, norm_qk=True,
                   rotary_percentage=0.5)


def fsdp_model() -> GPT:
    torch.manual_seed(0)
    model = GPT(Config(**FSDP_CONFIG))
    model.init_weights()
    with torch.no_grad():
        for block in model.transformer.h[1:]:
            block.mlp.gate.weight.normal_(0, 0.5)
            block.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    return model
