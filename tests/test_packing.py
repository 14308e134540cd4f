"""Packed finetuning (`litgpt.data.packing`, `--data.packing true`): the packer, the packed batches, and the model and
loss on packed samples against each sample run alone, unpacked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from litgpt.config import Config
from litgpt.data.base import IGNORE_INDEX, MicroBatches, collate
from litgpt.data.packing import PackedDataset, pack_samples
from litgpt.errors import UserError
from litgpt.lora import LoRASettings, add_lora, mark_only_lora_as_trainable
from litgpt.model import GPT
from litgpt.train.loss import loss_function
from test_training import base_checkpoint  # noqa: F401 - a fixture

TINY = dict(block_size=32, vocab_size=50, padded_vocab_size=64, n_layer=2, n_embd=32, n_head=4, n_query_groups=2,
            intermediate_size=48, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", rotary_percentage=1.0)


class Samples:
    """Instruction-like samples of the given lengths: random tokens, the first `prompt` labels masked."""

    def __init__(self, lengths, prompt=2, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.samples = []
        for n in lengths:
            input_ids = torch.randint(0, 50, (n,), generator=generator)
            labels = torch.randint(0, 50, (n,), generator=generator)
            labels[:prompt] = IGNORE_INDEX
            self.samples.append({"input_ids": input_ids, "labels": labels})

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index]


def test_pack_samples_fills_best_fit_decreasing_and_depends_only_on_the_seed():
    lengths = [7, 3, 5, 2, 6, 4, 1, 8]  # 36 tokens: best-fit decreasing makes {8,2}, {7,3}, {6,4}, {5,1} at 10
    packs = pack_samples(lengths, 10, seed=0)
    assert sorted(sorted(lengths[i] for i in pack) for pack in packs) == [[1, 5], [2, 8], [3, 7], [4, 6]]
    assert sorted(i for pack in packs for i in pack) == list(range(len(lengths)))
    assert pack_samples(lengths, 10, seed=0) == packs
    ties = [4] * 12
    assert pack_samples(ties, 8, seed=1) != pack_samples(ties, 8, seed=2)  # the seed orders equal lengths
    for seed in range(5):
        random = torch.randint(1, 30, (200,), generator=torch.Generator().manual_seed(seed)).tolist()
        result = pack_samples(random, 32, seed)
        assert all(sum(random[i] for i in pack) <= 32 for pack in result)
        assert sorted(i for pack in result for i in pack) == list(range(200))
    with pytest.raises(ValueError, match="longer than the pack capacity"):
        pack_samples([5, 11], 10, seed=0)


def test_packed_batches_concatenate_samples_restart_positions_and_pad_only_the_tail():
    data = Samples([5, 3, 4, 6])
    packed = PackedDataset(data, max_seq_length=10, seed=0)
    assert len(packed) == 2 and packed.fill() == pytest.approx(18 / 20)
    batch = collate([packed[0], packed[1]])
    for row, pack in enumerate(packed.packs):
        n = sum(data[i]["input_ids"].numel() for i in pack)
        assert torch.equal(batch["input_ids"][row, :n], torch.cat([data[i]["input_ids"] for i in pack]))
        assert torch.equal(batch["labels"][row, :n], torch.cat([data[i]["labels"] for i in pack]))
        assert (batch["labels"][row, n:] == IGNORE_INDEX).all() and (batch["input_ids"][row, n:] == 0).all()
        expected = torch.cat([torch.arange(data[i]["input_ids"].numel()) for i in pack])
        expected = torch.cat([expected, torch.arange(expected[-1] + 1, expected[-1] + 1 + 10 - n)])
        assert torch.equal(batch["positions"][row], expected[: batch["positions"].size(1)])


def test_packed_loader_resumes_where_it_stopped():
    packed = PackedDataset(Samples([1 + i % 23 for i in range(40)]), max_seq_length=24, seed=3)
    loader = MicroBatches(packed, micro_batch_size=2, seed=5)
    whole = [batch["positions"] for _, (_, _, batch) in zip(range(2 * loader.per_epoch), loader.iterate())]
    again = PackedDataset(Samples([1 + i % 23 for i in range(40)]), 24, seed=3)
    resumed = MicroBatches(again, 2, seed=5).iterate(epoch=1, position=1)
    assert torch.equal(next(resumed)[2]["positions"], whole[loader.per_epoch + 1])


def unpacked_reference(model, samples):
    """Each sample alone: its summed cross-entropy over its labelled tokens, and the number of those tokens."""
    sums, counts = [], []
    for s in samples:
        logits = model(s["input_ids"][None])[0]
        sums.append(F.cross_entropy(logits, s["labels"], ignore_index=IGNORE_INDEX, reduction="sum"))
        counts.append((s["labels"] != IGNORE_INDEX).sum())
    return torch.stack(sums), torch.stack(counts)


def packed_per_sample(model, data, packed, batch):
    """The summed cross-entropy of each sample, read from the packed batch's logits, in the packs' order."""
    logits = model(batch["input_ids"], sample_positions=batch["positions"])
    token_losses = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="none").view_as(batch["labels"])
    sums = []
    for row, pack in enumerate(packed.packs):
        start = 0
        for i in pack:
            n = data[i]["input_ids"].numel()
            sums.append(token_losses[row, start:start + n].sum())
            start += n
    return torch.stack(sums)


@pytest.mark.parametrize("variant", [
    dict(),
    # Gemma-2-like: a sliding window on every other layer and soft-capped scores and logits (the masks compose).
    dict(sliding_window_size=4, sliding_window_pattern=2, attention_logit_softcapping=20.0,
         final_logit_softcapping=5.0),
    dict(lora=True),
], ids=["plain", "sliding_softcap", "lora"])
def test_packed_losses_and_gradient_equal_the_samples_run_alone(variant):
    """Float32, samples of different lengths (prompt labels masked, one cut by the window's reach): each sample's
    loss from the packed batch equals its loss run alone within 1e-5, and so does the gradient of their sum; the
    recipe's chunked loss on the packed batch equals the labelled-token mean of the unpacked losses."""
    variant = dict(variant)
    lora = variant.pop("lora", False)
    torch.manual_seed(0)
    model = GPT(Config(**TINY, **variant))
    model.init_weights()
    if lora:
        add_lora(model, LoRASettings(r=4, dropout=0.0, mlp=True))
        mark_only_lora_as_trainable(model)
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                torch.nn.init.normal_(param, std=0.1)  # B starts at zero; make the adapters matter
    data = Samples([9, 3, 14, 6, 11, 5, 7])
    packed = PackedDataset(data, max_seq_length=20, seed=0)
    batch = collate([packed[i] for i in range(len(packed))])
    assert batch["input_ids"].size(0) < len(data)  # several samples share a row
    params = [p for p in model.parameters() if p.requires_grad]
    order = [i for pack in packed.packs for i in pack]

    want_sums, counts = unpacked_reference(model, [data[i] for i in order])
    want_grads = torch.autograd.grad(want_sums.sum(), params)
    got_sums = packed_per_sample(model, data, packed, batch)
    got_grads = torch.autograd.grad(got_sums.sum(), params)
    assert (got_sums / counts - want_sums / counts).abs().max() < 1e-5
    for got, want in zip(got_grads, want_grads):
        assert (got - want).abs().max() < 1e-5

    chunked = loss_function("cross_entropy", chunk_size=7)(model, batch["input_ids"], batch["labels"],
                                                            batch["positions"])["loss"]
    assert abs(chunked.item() - (want_sums.sum() / counts.sum()).item()) < 1e-5
    chunked_grads = torch.autograd.grad(chunked, params)
    mean_grads = torch.autograd.grad(unpacked_reference(model, [data[i] for i in order])[0].sum() / counts.sum(),
                                     params)
    for got, want in zip(chunked_grads, mean_grads):
        assert (got - want).abs().max() < 1e-5


def test_generation_with_a_kv_cache_is_unchanged_by_the_new_argument():
    """The KV cache path ignores packing: decoding still matches the full forward's logits."""
    torch.manual_seed(0)
    model = GPT(Config(**TINY))
    model.init_weights()
    x = torch.randint(0, 50, (1, 8))
    full = model(x)
    model.set_kv_cache(1)
    step = torch.cat([model(x[:, :5], torch.arange(5)), model(x[:, 5:], torch.arange(5, 8))], dim=1)
    assert (full - step).abs().max() < 1e-5


def test_packing_pretraining_text_says_so_in_one_line():
    from litgpt.data import Tiny

    with pytest.raises(UserError, match="--data.packing is for instruction data") as error:
        Tiny(packing=True).check_packing()
    assert "\n" not in str(error.value)
    Tiny().check_packing()


def test_instruction_data_packs_and_cuts_long_samples_like_unpacked(tmp_path):
    """`JSON(packing=True)`: the training set is packed (a sample longer than max_seq_length cut as without
    packing), the validation set is not."""
    import json

    from litgpt.data import JSON
    from litgpt.data.tiny import TOKENIZER_DIR
    from litgpt.tokenizer import Tokenizer

    records = [{"instruction": f"Say {'a word ' * (1 + 12 * (i % 5))}", "output": "ok " * (1 + i % 4)}
               for i in range(20)]
    (tmp_path / "data.json").write_text(json.dumps(records))
    plain = JSON(tmp_path / "data.json", val_split_fraction=0.1, prompt_style="default")
    packing = JSON(tmp_path / "data.json", val_split_fraction=0.1, prompt_style="default", packing=True)
    tokenizer = Tokenizer(TOKENIZER_DIR)
    for data in (plain, packing):
        data.connect(tokenizer, max_seq_length=64)
        data.prepare()
    samples, packed = plain.train_dataset(), packing.train_dataset()
    assert max(s["input_ids"].numel() for s in samples) == 64  # some are cut
    assert len(packed) < len(samples)
    assert all(packed[i]["input_ids"].numel() <= 64 for i in range(len(packed)))
    tokens = sorted(tuple(samples[i]["input_ids"].tolist()) for i in range(len(samples)))
    starts = [packed[p]["positions"].eq(0).nonzero().flatten().tolist() + [packed[p]["positions"].numel()]
              for p in range(len(packed))]
    pieces = sorted(tuple(packed[p]["input_ids"][a:b].tolist()) for p in range(len(packed))
                    for a, b in zip(starts[p], starts[p][1:]))
    assert pieces == tokens
    assert "positions" not in packing.val_dataset()[0]


@pytest.fixture(scope="module")
def short_instructions(tmp_path_factory):
    """Sixty instruction records of 10 to 60 tokens in the default style: several fit in one 128-token sequence."""
    import json

    from litgpt.data.tiny import TINY_DIR

    path = tmp_path_factory.mktemp("packing") / "short.jsonl"
    sentences = (TINY_DIR / "val.txt").read_text().replace("\n\n", " ").split(". ")[:120]
    with open(path, "w") as f:
        for i in range(60):
            record = {"instruction": sentences[2 * i] + ".", "output": sentences[2 * i + 1][:20 + 4 * i]}
            f.write(json.dumps(record) + "\n")
    return path


def finetune_packed(out_dir, base, data_path, resume=False):
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.data import JSON
    from litgpt.finetune.lora import setup

    setup(base, out_dir=out_dir, data=JSON(data_path, val_split_fraction=0.1, prompt_style="default", packing=True),
          train=TrainArgs(global_batch_size=4, micro_batch_size=2, max_steps=6, lr_warmup_steps=2, save_interval=3,
                          log_interval=1, max_seq_length=128),
          eval=EvalArgs(interval=1000, max_iters=2, max_new_tokens=None), devices=1, resume=resume, seed=3,
          lora_r=4, lora_alpha=8, lora_dropout=0.1, lora_mlp=True)


def test_packed_lora_finetuning_resumes_exactly(tmp_path, base_checkpoint, short_instructions, capsys):
    """`finetune_lora` with packing through the real trainer: stopped after step 3 and resumed, it ends with the
    weights of an uninterrupted run (the packs and their order are a function of the seed)."""
    from test_training import assert_same_weights, drop_after, weights

    finetune_packed(tmp_path / "whole", base_checkpoint, short_instructions)
    assert "Packed 54 training samples into" in capsys.readouterr().out
    finetune_packed(tmp_path / "stopped", base_checkpoint, short_instructions)
    drop_after(tmp_path / "stopped", 3)
    finetune_packed(tmp_path / "stopped", base_checkpoint, short_instructions, resume="auto")
    name = "lit_model.pth.lora"
    assert_same_weights(weights(tmp_path / "whole" / "final", name), weights(tmp_path / "stopped" / "final", name), 0)


@pytest.mark.parametrize("chunked", [True, False])
def test_packed_distillation_loss_equals_the_samples_distilled_alone(chunked):
    """The teacher sees the packed positions too: the packed KD + CE loss equals the labelled-token mean of each
    sample distilled alone."""
    from test_distill import tiny_models

    from litgpt.args import KDArgs
    from litgpt.train.loss import distillation_loss_function

    student, teacher = tiny_models(dict(final_logit_softcapping=15.0))
    loss = distillation_loss_function(teacher, KDArgs("forward_kl", temperature=2.0, alpha=0.5), chunk_size=5,
                                      chunked=chunked)
    data = Samples([5, 7, 4], seed=1)
    packed = PackedDataset(data, max_seq_length=16, seed=0)
    assert len(packed) == 1
    batch = collate([packed[0]])
    got = loss(student, batch["input_ids"], batch["labels"], batch["positions"])
    totals = {name: 0.0 for name in got}
    count = 0
    for s in data.samples:
        alone = loss(student, s["input_ids"][None], s["labels"][None])
        n = (s["labels"] != IGNORE_INDEX).sum().item()
        for name in totals:
            totals[name] += alone[name].item() * n
        count += n
    for name, value in got.items():
        assert abs(value.item() - totals[name] / count) < 1e-5, name
