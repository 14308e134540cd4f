"""`litgpt dpo`: preference optimization as a recipe of the shared job and trainer.

References: TRL's own DPOTrainer (and its CPO/ORPO trainers for SimPO and ORPO) on the same model converted to
transformers and the same batch; transformers' `apply_chat_template` for the chat layout; a hand count of tokens for
the data layout; the models' own log-probabilities, computed here, for what training learned; one process for two.
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import write_random_checkpoint
from litgpt_forkserver import run_litgpt
from test_data import write_jsonl

from litgpt.config import Config
from litgpt.data.base import IGNORE_INDEX
from litgpt.io import load_state_dict
from litgpt.model import GPT
from litgpt.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(name="pairs", block_size=64, vocab_size=4096, padded_vocab_size=4096, n_layer=2, n_embd=32, n_head=4,
             n_query_groups=2, intermediate_size=64)
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "white", "black"]
ANIMALS = ["dog", "cat", "horse", "mouse", "bird", "fish", "frog", "goat"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def litgpt(*args, timeout: int = 600, **env):
    return run_litgpt(args, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, timeout=timeout)


def color_pairs(count: int, seed: int) -> list[dict]:
    """Pairs whose chosen answer is always a color and rejected one an animal, in random combinations."""
    rng = random.Random(seed)
    return [{"prompt": f"Name a thing number {rng.randrange(100)}:", "chosen": f" {rng.choice(COLORS)}",
             "rejected": f" {rng.choice(ANIMALS)}"} for _ in range(count)]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("dpo") / "base", Config(**SMALL), seed=4)


@pytest.fixture(scope="module")
def color_data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("colors")
    write_jsonl(folder / "train.jsonl", color_pairs(64, seed=0))
    write_jsonl(folder / "val.jsonl", color_pairs(32, seed=1))
    return folder


def dpo_args(base: Path, data: Path, out: Path, *extra) -> list:
    return ["dpo", base, "--data", "Preference", "--data.json_path", data, "--data.prompt_style", "default",
            "--out_dir", out, "--precision", "32-true", "--devices", "1", "--train.micro_batch_size", "4",
            "--train.global_batch_size", "8", "--train.max_seq_length", "32", "--train.lr_warmup_steps", "0",
            "--train.log_interval", "1", "--eval.interval", "1000", "--eval.max_iters", "2",
            "--eval.max_new_tokens", "0", "--lora_dropout", "0", *extra]


def logged_rows(out_dir: Path) -> list[dict]:
    (path,) = (out_dir / "logs").rglob("metrics.csv")
    with open(path) as f:
        return [row for row in csv.DictReader(f) if row.get("rewards/chosen")]


# ---- what the model learned, measured here -----------------------------------------------------------------------
@torch.no_grad()
def answer_logp(model: GPT, tokenizer: Tokenizer, prompt: str, answer: str) -> float:
    """log p(answer + EOS | prompt) under `model`: the prompt's tokens, the answer's, EOS, summed by hand."""
    prompt_ids = tokenizer.encode(prompt).tolist()
    answer_ids = tokenizer.encode(answer, bos=False).tolist() + [tokenizer.eos_id]
    tokens = torch.tensor([prompt_ids + answer_ids])
    logps = torch.log_softmax(model(tokens[:, :-1]).float(), dim=-1)[0]
    return sum(logps[len(prompt_ids) - 1 + i, token].item() for i, token in enumerate(answer_ids))


def preference_accuracy(folder: Path, rows: list[dict]) -> float:
    """The share of pairs whose chosen answer the model in `folder` finds more likely than the rejected one."""
    model = GPT(Config.from_checkpoint(folder))
    model.load_state_dict(load_state_dict(folder / "lit_model.pth"))
    tokenizer = Tokenizer(folder)
    model.eval()
    wins = [answer_logp(model, tokenizer, r["prompt"], r["chosen"]) > answer_logp(model, tokenizer, r["prompt"],
                                                                                   r["rejected"]) for r in rows]
    return sum(wins) / len(wins)


@pytest.mark.parametrize(("method", "lr"), [("lora", "2e-2"), pytest.param("full", "2e-3", marks=pytest.mark.slow)])
def test_it_learns_and_starts_where_the_policy_is_its_reference(tmp_path, base, color_data, method, lr):
    """At step 1 the policy is its reference: the sigmoid loss is ln 2 and every reward and margin 0. Then held-out
    preference accuracy rises from chance to at least 0.9."""
    out = tmp_path / "out"
    run = litgpt(*dpo_args(base, color_data, out, "--method", method, "--train.max_steps", "8",
                           "--optimizer.lr", lr, "--lora_mlp", "true"))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    rows = logged_rows(out)
    first = rows[0]
    assert float(first["loss"]) == pytest.approx(math.log(2), abs=1e-6)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert float(first[name]) == pytest.approx(0.0, abs=1e-7), name
    assert "rewards/margins" in run.stdout  # TRL's names in the log line
    metrics = json.loads((out / "metrics.json").read_text())
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                 "logps/rejected", "val_rewards/accuracies"):
        assert name in metrics, name
    held_out = [json.loads(line) for line in (color_data / "val.jsonl").read_text().splitlines()]
    before = preference_accuracy(base, held_out)
    after = preference_accuracy(out / "final", held_out)
    assert 0.25 <= before <= 0.75, before
    assert after >= 0.9, (before, after)
    assert metrics["rewards/margins"] > 0


def test_qlora_starts_at_its_quantized_reference_and_trains_the_adapters(tmp_path, base, color_data):
    """--quantize: the reference is the 4-bit base itself (adapters off), so step 1 is again ln 2; only the adapters
    are saved."""
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "out"
    run = litgpt(*dpo_args(base, color_data, out, "--quantize", "bnb.nf4", "--train.max_steps", "2",
                           "--optimizer.lr", "2e-2"))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = logged_rows(out)
    assert float(rows[0]["loss"]) == pytest.approx(math.log(2), abs=1e-6) and len(rows) == 2
    assert float(rows[1]["rewards/margins"]) != 0.0
    saved = load_state_dict(out / "final" / "lit_model.pth.lora")
    assert saved and all("lora_" in key for key in saved)


def test_bad_input_is_one_line(tmp_path, base):
    good = write_jsonl(tmp_path / "good.jsonl", color_pairs(8, seed=0))
    no_rejected = write_jsonl(tmp_path / "no_rejected.jsonl", [{"prompt": "a", "chosen": " b"}])
    same = write_jsonl(tmp_path / "same.jsonl", [{"prompt": "a", "chosen": " b", "rejected": " b"}] * 4)
    cases = [
        (no_rejected, ["--data.val_split_fraction", "0.5"], 'missing "rejected"'),
        (same, ["--data.val_split_fraction", "0.5"], '"chosen" and "rejected" are the same answer'),
        (good, ["--data.val_split_fraction", "0.5", "--data.max_prompt_length", "40"], "leaves no room for the answer"),
        (good, ["--data.val_split_fraction", "0.5", "--dpo.beta", "0"], "--dpo.beta 0.0 must be a finite number"),
        (good, ["--data.val_split_fraction", "0.5", "--dpo.loss", "simpo", "--dpo.precompute_reference", "true"],
         "reference-free"),
    ]
    for data, extra, message in cases:
        run = litgpt(*dpo_args(base, data, tmp_path / "out", "--train.max_steps", "1", *extra))
        assert run.returncode == 1, (message, run.stderr[-2000:])
        errors = [line for line in run.stderr.splitlines() if line.startswith("litgpt")]  # litgpt's own lines
        assert len(errors) == 1 and message in errors[0], (message, run.stderr[-2000:])
        assert "Traceback" not in run.stderr
    assert not (tmp_path / "out" / "final").exists()


# ---- TRL's computation on the same model and batch ---------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """A tiny Hugging Face Llama as the policy and another as the reference, each also converted to litgpt."""
    from hf_models import save_hf_model

    from litgpt.convert.hf_to_litgpt import convert_hf_checkpoint

    folders = {}
    for name, seed in (("policy", 0), ("reference", 1)):
        folder = tmp_path_factory.mktemp(name)
        save_hf_model("llama", folder, seed=seed)
        convert_hf_checkpoint(folder)
        folders[name] = folder
    return folders


def token_pairs(count: int = 3, vocab: int = 211):
    """(prompt, chosen, rejected) token lists of different lengths."""
    generator = torch.Generator().manual_seed(7)
    lengths = [(5, 4, 6), (3, 7, 2), (8, 3, 3)][:count]
    return [tuple(torch.randint(3, vocab, (n,), generator=generator).tolist() for n in sizes) for sizes in lengths]


def trl_inputs(pairs) -> dict:
    """TRL's collated batch: chosen rows then rejected rows, right-padded, with its completion mask."""
    rows = [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs]
    length = max(len(p) + len(a) for p, a in rows)
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention, completion = torch.zeros_like(input_ids), torch.zeros_like(input_ids)
    for i, (prompt, answer) in enumerate(rows):
        n = len(prompt) + len(answer)
        input_ids[i, :n] = torch.tensor(prompt + answer)
        attention[i, :n] = 1
        completion[i, len(prompt):n] = 1
    return {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion}


def our_batch(inputs: dict) -> dict:
    """The same batch as ours: shifted, only the answers' tokens labelled."""
    tokens = inputs["input_ids"]
    labels = torch.where(inputs["completion_mask"][:, 1:].bool(), tokens[:, 1:], IGNORE_INDEX)
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": labels}


def load_gpt(folder: Path) -> GPT:
    model = GPT(Config.from_checkpoint(folder))
    model.load_state_dict(load_state_dict(folder / "lit_model.pth"))
    return model


# Our parameter names -> transformers' Llama names, for the gradients compared
GRADIENT_NAMES = {"lm_head.weight": "lm_head.weight", "transformer.wte.weight": "model.embed_tokens.weight",
                  "transformer.ln_f.weight": "model.norm.weight",
                  "transformer.h.1.mlp.proj.weight": "model.layers.1.mlp.down_proj.weight"}
LOGGED = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
          "logps/rejected")


@pytest.mark.parametrize(("loss", "beta", "smoothing"), [
    ("sigmoid", 0.1, 0.0), ("ipo", 0.5, 0.0), ("hinge", 0.3, 0.0), ("robust", 0.2, 0.1)])
def test_loss_rewards_and_gradients_equal_trls_dpo_trainer(tmp_path, hf_models, loss, beta, smoothing):
    trl = pytest.importorskip("trl")
    import datasets
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from litgpt.args import DPOArgs
    from litgpt.train.recipes.dpo import DPORecipe, PreferenceSettings

    hf_policy = AutoModelForCausalLM.from_pretrained(hf_models["policy"]).float().train()
    hf_reference = AutoModelForCausalLM.from_pretrained(hf_models["reference"]).float().eval()
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(ROOT / "litgpt/data/tiny/tokenizer/tokenizer.json"),
                                        eos_token="</s>", pad_token="</s>")
    rows = datasets.Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}])
    config = trl.DPOConfig(output_dir=str(tmp_path), loss_type=[loss], beta=beta, label_smoothing=smoothing,
                           report_to=[], use_cpu=True, disable_dropout=True, bf16=False)
    trainer = trl.DPOTrainer(model=hf_policy, ref_model=hf_reference, args=config, train_dataset=rows,
                             processing_class=tokenizer)
    inputs = trl_inputs(token_pairs())
    theirs = trainer.compute_loss(hf_policy, inputs)
    theirs.backward()
    their_metrics = {name: trainer._metrics["train"][name][-1] for name in LOGGED}

    policy, reference = load_gpt(hf_models["policy"]), load_gpt(hf_models["reference"]).eval()
    recipe = DPORecipe(name="dpo", config=policy.config,
                       preference=PreferenceSettings(DPOArgs(loss=loss, beta=beta, label_smoothing=smoothing)))
    forwards = []  # the rows of each forward pass of the policy
    policy.register_forward_hook(lambda module, args, output: forwards.append(args[0].shape[0]))
    ours = recipe.objective({"reference": reference}).train_loss(policy, our_batch(inputs))
    ours["loss"].backward()
    assert forwards == [2 * len(token_pairs())]  # chosen and rejected in one forward pass

    assert ours["loss"].item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-6)
    for name in LOGGED:
        assert ours[name].item() == pytest.approx(their_metrics[name], rel=1e-5, abs=1e-6), name
    hf_parameters = dict(hf_policy.named_parameters())
    for ours_name, their_name in GRADIENT_NAMES.items():
        our_grad = dict(policy.named_parameters())[ours_name].grad
        their_grad = hf_parameters[their_name].grad
        torch.testing.assert_close(our_grad[: their_grad.shape[0]], their_grad, rtol=1e-4, atol=1e-6)


# ---- the reference precomputed, resume, several processes ----------------------------------------------------------
def losses_by_step(out_dir: Path) -> torch.Tensor:
    return torch.tensor([[float(row[name]) for name in ("loss", *LOGGED)] for row in logged_rows(out_dir)])


@pytest.mark.slow
def test_a_precomputed_reference_trains_as_the_live_one_and_a_killed_run_resumes_bit_exact(tmp_path, base,
                                                                                              color_data):
    common = ["--method", "full", "--train.max_steps", "4", "--train.save_interval", "2", "--optimizer.lr", "2e-3"]
    live = litgpt(*dpo_args(base, color_data, tmp_path / "live", *common))
    assert live.returncode == 0, live.stderr[-3000:]
    precomputed = [*common, "--dpo.precompute_reference", "true"]
    once = litgpt(*dpo_args(base, color_data, tmp_path / "once", *precomputed))
    assert once.returncode == 0, once.stderr[-3000:]
    assert "Computing the reference's log-probabilities of 96 pairs once" in once.stdout
    assert (tmp_path / "once" / "reference_logps.pt").is_file()
    torch.testing.assert_close(losses_by_step(tmp_path / "once"), losses_by_step(tmp_path / "live"), rtol=0,
                               atol=1e-5)

    killed = tmp_path / "killed"
    run = litgpt(*dpo_args(base, color_data, killed, *precomputed), LITGPT_FAILPOINT="step:end@3",
                 LITGPT_FAILPOINTS_ARMED="1")
    assert run.returncode != 0 and not (killed / "final").exists()
    run = litgpt(*dpo_args(base, color_data, killed, *precomputed, "--resume", "auto"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Read the reference's log-probabilities from" in run.stdout and "step-000002" in run.stdout
    ours, theirs = (load_state_dict(out / "final" / "lit_model.pth") for out in (killed, tmp_path / "once"))
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "full"])
def test_two_fully_sharded_processes_equal_one(tmp_path, base, color_data, method):
    """The same global batch of pairs on 1 process and on 2 (FSDP FULL_SHARD; under full finetuning the frozen
    reference sharded like the policy): the same losses and rewards at every step."""
    common = ["--method", method, "--train.max_steps", "3", "--optimizer.lr", "2e-3", "--lora_mlp", "true"]
    one = litgpt(*dpo_args(base, color_data, tmp_path / "one", *common))
    assert one.returncode == 0, one.stderr[-3000:]
    two = litgpt(*dpo_args(base, color_data, tmp_path / "two", *common), "--devices", "2",
                 "--fsdp.sharding_strategy", "FULL_SHARD", "--train.micro_batch_size", "2")
    assert two.returncode == 0, two.stderr[-3000:]
    torch.testing.assert_close(losses_by_step(tmp_path / "two"), losses_by_step(tmp_path / "one"), rtol=0, atol=1e-5)


def trl_pair_batch(inputs: dict) -> dict:
    """The batch of TRL's CPO and ORPO trainers: chosen_* and rejected_* input ids, attention masks and labels (the
    answers' tokens, -100 elsewhere)."""
    half = inputs["input_ids"].size(0) // 2
    labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, IGNORE_INDEX)
    batch = {}
    for name, rows in (("chosen", slice(0, half)), ("rejected", slice(half, None))):
        batch[f"{name}_input_ids"] = inputs["input_ids"][rows]
        batch[f"{name}_attention_mask"] = inputs["attention_mask"][rows]
        batch[f"{name}_labels"] = labels[rows]
    return batch


@pytest.mark.parametrize(("loss", "beta", "smoothing"), [("simpo", 2.0, 0.0), ("simpo", 2.5, 0.1), ("orpo", 0.2, 0.0)])
def test_reference_free_losses_equal_trls_cpo_and_orpo_trainers(tmp_path, hf_models, loss, beta, smoothing):
    """SimPO is TRL's CPOTrainer with loss_type simpo and cpo_alpha 0; ORPO its ORPOTrainer: the same loss, rewards
    and gradients on the same model and batch."""
    pytest.importorskip("trl")
    import datasets
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    from litgpt.args import DPOArgs
    from litgpt.train.recipes.dpo import DPORecipe, PreferenceSettings

    hf_policy = AutoModelForCausalLM.from_pretrained(hf_models["policy"]).float().train()
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(ROOT / "litgpt/data/tiny/tokenizer/tokenizer.json"),
                                        eos_token="</s>", pad_token="</s>")
    rows = datasets.Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}])
    common = dict(output_dir=str(tmp_path), beta=beta, report_to=[], use_cpu=True, bf16=False, max_length=64)
    if loss == "simpo":
        config = CPOConfig(loss_type="simpo", cpo_alpha=0.0, simpo_gamma=0.5, label_smoothing=smoothing, **common)
        trainer = CPOTrainer(model=hf_policy, args=config, train_dataset=rows, processing_class=tokenizer)
    else:
        trainer = ORPOTrainer(model=hf_policy, args=ORPOConfig(**common), train_dataset=rows,
                              processing_class=tokenizer)
    inputs = trl_inputs(token_pairs())
    theirs, their_metrics = trainer.get_batch_loss_metrics(hf_policy, trl_pair_batch(inputs))
    theirs.backward()

    policy = load_gpt(hf_models["policy"])
    args = DPOArgs(loss=loss, beta=beta, label_smoothing=smoothing)
    recipe = DPORecipe(name="dpo", config=policy.config, preference=PreferenceSettings(args))
    ours = recipe.objective({}).train_loss(policy, our_batch(inputs))
    ours["loss"].backward()

    assert ours["loss"].item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-6)
    for name in LOGGED[:4] + (("nll_loss",) if loss == "orpo" else ()):
        assert ours[name].item() == pytest.approx(their_metrics[name], rel=1e-5, abs=1e-6), name
    hf_parameters = dict(hf_policy.named_parameters())
    for ours_name, their_name in GRADIENT_NAMES.items():
        our_grad = dict(policy.named_parameters())[ours_name].grad
        torch.testing.assert_close(our_grad[: hf_parameters[their_name].grad.shape[0]], hf_parameters[their_name].grad,
                                   rtol=1e-4, atol=1e-6)


# ---- data: layout, chat template, cutting --------------------------------------------------------------------------
CONVERSATION = {
    "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Which color is the sky?"}],
    "chosen": [{"role": "assistant", "content": "Blue."}],
    "rejected": [{"role": "assistant", "content": "A dog, I think."}],
}


def test_the_checkpoints_chat_template_renders_as_transformers_renders_it(tmp_path):
    from tokenizer_helpers import make_tokenizer_folder
    from transformers import AutoTokenizer

    from litgpt.chat_template import ChatTemplate

    folder = make_tokenizer_folder(tmp_path / "chatml", "chatml")
    theirs = AutoTokenizer.from_pretrained(folder)
    ours = ChatTemplate.from_checkpoint(folder)
    for messages in (CONVERSATION["prompt"], CONVERSATION["prompt"] + CONVERSATION["chosen"]):
        for opened in (False, True):
            assert ours.render(messages, add_generation_prompt=opened) == theirs.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=opened)
    assert ChatTemplate.from_checkpoint(ROOT / "litgpt" / "data" / "tiny" / "tokenizer") is None
    (folder / "chat_template.jinja").write_text("{{ ''.__class__.__mro__ }}")  # a template from a stranger
    from litgpt.errors import UserError
    with pytest.raises(UserError, match="chat template"):
        ChatTemplate.from_checkpoint(folder).render(CONVERSATION["prompt"])


def test_a_conversation_is_tokenized_as_transformers_lays_it_out_and_only_the_answer_is_labelled(tmp_path):
    from tokenizer_helpers import make_tokenizer_folder
    from transformers import AutoTokenizer

    from litgpt.data import Preference

    folder = make_tokenizer_folder(tmp_path / "chatml", "chatml")
    hf = AutoTokenizer.from_pretrained(folder)
    data = Preference(json_path=write_jsonl(tmp_path / "pairs.jsonl", [CONVERSATION] * 2), val_split_fraction=0.5)
    data.connect(Tokenizer(folder), max_seq_length=256)
    sample = data.train_dataset()[0]
    prompt = hf.apply_chat_template(CONVERSATION["prompt"], tokenize=False, add_generation_prompt=True)
    prompt_ids = hf(prompt, add_special_tokens=False)["input_ids"]
    for answer, prefix in ((CONVERSATION["chosen"], ""), (CONVERSATION["rejected"], "rejected_")):
        whole = hf.apply_chat_template(CONVERSATION["prompt"] + answer, tokenize=False)
        tokens = hf(whole, add_special_tokens=False)["input_ids"]
        assert sample[f"{prefix}input_ids"].tolist() == tokens[:-1]
        expected = [IGNORE_INDEX] * (len(prompt_ids) - 1) + tokens[len(prompt_ids):]
        assert sample[f"{prefix}labels"].tolist() == expected
        assert hf.decode(tokens[len(prompt_ids):]).startswith(answer[0]["content"])


def test_text_pairs_implicit_prompts_and_pairs_cut_to_the_length(tmp_path, capsys):
    from litgpt.data import Preference
    from litgpt.data.tiny import TOKENIZER_DIR
    from litgpt.prompts import PromptStyle

    tokenizer = Tokenizer(TOKENIZER_DIR)
    rows = [
        {"prompt": "Name a color:", "chosen": " red", "rejected": " dog"},
        {"chosen": "Name a color: blue", "rejected": "Name a color: cat"},  # TRL's implicit prompt
        {"prompt": "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen",
         "chosen": " red green blue", "rejected": " dog"},
    ]
    write_jsonl(tmp_path / "pairs" / "train.jsonl", rows)
    write_jsonl(tmp_path / "pairs" / "val.jsonl", rows[:1])
    data = Preference(json_path=tmp_path / "pairs", prompt_style="default")
    data.connect(tokenizer, max_seq_length=15, prompt_style=PromptStyle.from_name("alpaca"))
    data.prepare()
    train = data.train_dataset()
    eos = tokenizer.eos_id

    def expect(prompt: list[int], answer: list[int], sample_ids, sample_labels):
        tokens = prompt + answer
        assert sample_ids.tolist() == tokens[:-1]
        assert sample_labels.tolist() == [IGNORE_INDEX] * (len(prompt) - 1) + answer

    prompt = tokenizer.encode("Name a color:").tolist()
    for index, (chosen, rejected) in enumerate(((" red", " dog"), (" blue", " cat"))):
        sample = train[index]
        expect(prompt, tokenizer.encode(chosen, bos=False).tolist() + [eos], sample["input_ids"], sample["labels"])
        expect(prompt, tokenizer.encode(rejected, bos=False).tolist() + [eos], sample["rejected_input_ids"],
               sample["rejected_labels"])
    # 16 tokens per sequence at most: the longer answer (with EOS) whole, the prompt's end in the rest of the room
    long_prompt = tokenizer.encode(rows[2]["prompt"]).tolist()
    chosen = tokenizer.encode(" red green blue", bos=False).tolist() + [eos]
    kept = long_prompt[len(long_prompt) - (16 - len(chosen)):]
    expect(kept, chosen, train[2]["input_ids"], train[2]["labels"])
    assert len(train[2]["input_ids"]) == 15
    assert "Cut 1 of 3 training pairs to --train.max_seq_length 15" in capsys.readouterr().out

    batch = type(train).collate([train[0], train[2]])  # chosen rows first, then rejected, right-padded
    assert batch["input_ids"].shape == (4, 15)
    rejected = train[0]["rejected_input_ids"]
    assert batch["input_ids"][2, : len(rejected)].tolist() == rejected.tolist()
    assert (batch["labels"][0, len(train[0]["labels"]):] == IGNORE_INDEX).all()


def test_a_hugging_face_dataset_gives_the_same_pairs_as_its_json_file(tmp_path):
    pytest.importorskip("datasets")
    from litgpt.data import Preference
    from litgpt.data.tiny import TOKENIZER_DIR

    rows = color_pairs(10, seed=3)
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    pyarrow = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pyarrow.write_table(pa.Table.from_pylist(rows), tmp_path / "pairs.parquet")
    loaded = []
    for data in (Preference(json_path=path, val_split_fraction=0.2),
                 Preference(dataset=str(tmp_path / "pairs.parquet"), val_split_fraction=0.2)):
        data.connect(Tokenizer(TOKENIZER_DIR), max_seq_length=32)
        loaded.append([[t.tolist() for t in sample.values()] for sample in data.train_dataset()])
    assert loaded[0] == loaded[1] and len(loaded[0]) == 8


def test_the_plan_counts_two_sequences_per_pair_and_the_reference_each_way_holds():
    """A pair is two sequences in one forward pass: a micro batch of 2 pairs plans as 4 sequences of finetuning.
    The reference adds nothing as LoRA's adapters switched off, nor precomputed; as a frozen copy, its weights in the
    compute dtype (bf16-mixed: 2 bytes a parameter, counted here from the model itself)."""
    from litgpt.args import DPOArgs, TrainArgs
    from litgpt.plan.command import plan_for

    config = Config(**{**SMALL, "n_layer": 4, "n_embd": 128, "intermediate_size": 256})
    pairs = TrainArgs(micro_batch_size=2, max_seq_length=64)
    sequences = TrainArgs(micro_batch_size=4, max_seq_length=64)
    for method in ("lora", "full"):
        plain = plan_for(config, method=method, train=sequences)
        assert plan_for(config, method=method, train=pairs, dpo=DPOArgs(precompute_reference=True)).peak == plain.peak
        assert plan_for(config, method=method, train=pairs, dpo=DPOArgs(loss="simpo")).peak == plain.peak
    assert plan_for(config, method="lora", train=pairs, dpo=DPOArgs()).peak == plan_for(
        config, method="lora", train=sequences).peak
    with torch.device("meta"):
        parameters = sum(p.numel() for p in GPT(config).parameters())
    live = plan_for(config, method="full", train=pairs, dpo=DPOArgs())
    assert live.teacher_bytes == 2 * parameters
    assert live.peak == plan_for(config, method="full", train=sequences).peak + 2 * parameters
    assert "a frozen" in live.summary and "reference" in live.summary
