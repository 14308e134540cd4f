"""`litgpt distill`: the KD losses against hand computations, the frozen teacher, the CLI end to end (one process,
two FSDP processes, resume), a distilled student that is closer to its teacher than a CE-trained one, bad input."""

from __future__ import annotations

import csv
import hashlib
import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import write_random_checkpoint
from litgpt_forkserver import run_litgpt

from litgpt.__main__ import main as cli_main
from litgpt.args import KDArgs
from litgpt.config import Config
from litgpt.data.tiny import TINY_DIR
from litgpt.io import load_state_dict
from litgpt.model import GPT
from litgpt.tokenizer import Tokenizer
from litgpt.train.loss import (
    DistillationChunkLoss,
    OutputHead,
    _HeadInDtype,
    chunked_head_loss,
    distillation_loss_function,
    loss_function,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]
BASE = dict(block_size=64, vocab_size=4096, padded_vocab_size=4096, n_head=4, n_query_groups=2,
            norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", bias=False)
TEACHER = dict(name="kd-teacher", n_layer=2, n_embd=64, intermediate_size=128, **BASE)
STUDENT = dict(name="kd-student", n_layer=1, n_embd=32, intermediate_size=64, **BASE)
IGNORE = -100


# ---- the losses against a hand computation ---------------------------------------------------------------------------
def hand_kd(student_logits, teacher_logits, labels, name: str, temperature: float, alpha: float):
    """alpha * T^2 * mean divergence + (1 - alpha) * mean CE over labelled positions, written out with softmaxes:
    (total, kd, ce)."""
    log_q = torch.log_softmax(student_logits / temperature, dim=-1)
    log_p = torch.log_softmax(teacher_logits / temperature, dim=-1)
    q, p = log_q.exp(), log_p.exp()
    if name == "forward_kl":
        divergence = (p * (log_p - log_q)).sum(-1)
    elif name == "reverse_kl":
        divergence = (q * (log_q - log_p)).sum(-1)
    else:
        log_m = torch.log((p + q) / 2)
        divergence = 0.5 * (q * (log_q - log_m)).sum(-1) + 0.5 * (p * (log_p - log_m)).sum(-1)
    labelled = labels != IGNORE
    log_probs = torch.log_softmax(student_logits, dim=-1)
    nll = -log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    count = labelled.sum()
    kd = temperature**2 * divergence[labelled].sum() / count
    ce = nll[labelled].sum() / count
    return alpha * kd + (1 - alpha) * ce, kd, ce


@pytest.mark.parametrize("name", ["forward_kl", "reverse_kl", "js"])
@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_chunked_kd_loss_and_gradients_equal_the_hand_computation(name, chunk_size):
    """Random float64 hidden states and heads, T 1.7, alpha 0.3, masked positions: the chunked value, its parts and
    the gradients with respect to the student's hidden states and head equal autograd through `hand_kd`."""
    torch.manual_seed(0)
    batch, seq, vocab = 2, 9, 13
    hidden = torch.randn(batch, seq, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, 6, dtype=torch.float64, requires_grad=True)
    teacher_hidden = torch.randn(batch, seq, 8, dtype=torch.float64)
    teacher_weight = torch.randn(vocab, 8, dtype=torch.float64) * 2
    labels = torch.randint(0, vocab, (batch, seq))
    labels[0, :4] = IGNORE
    labels[1, 7] = IGNORE
    kd = KDArgs(name, temperature=1.7, alpha=0.3)

    chunk_loss = DistillationChunkLoss(kd, _HeadInDtype(teacher_weight, None, None, None, None, torch.float64))
    total = chunked_head_loss(hidden, OutputHead(weight), (labels, teacher_hidden), chunk_loss, chunk_size)
    count = (labels != IGNORE).sum()
    losses = chunk_loss.losses(total, count)
    grads = torch.autograd.grad(losses["loss"], (hidden, weight))

    expected, kd_part, ce_part = hand_kd(hidden @ weight.T, teacher_hidden @ teacher_weight.T, labels, name, 1.7, 0.3)
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    assert kd_part > 0.05 and ce_part > 0.05  # both terms matter
    # the chunk losses compute in float32 (the logits of a run are float32 there)
    for got, want in ((losses["loss"], expected), (losses["kd_loss"], kd_part), (losses["ce_loss"], ce_part)):
        torch.testing.assert_close(got.double(), want.detach(), rtol=0, atol=2e-6)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def tiny_models(teacher_changes: dict = {}):
    torch.manual_seed(1)
    teacher = GPT(Config(**{**TEACHER, **teacher_changes}))
    teacher.init_weights()
    with torch.no_grad():  # a confident teacher: its distribution is far from the student's
        teacher.lm_head.weight.mul_(20)
    teacher.requires_grad_(False)
    student = GPT(Config(**STUDENT))
    student.init_weights()
    return student, teacher


@pytest.mark.parametrize("name", ["forward_kl", "reverse_kl", "js"])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_model_distillation_loss_equals_the_hand_computation(name, chunked, alpha):
    """The loss a run trains with, on real models (a teacher with a biased, soft-capped head): chunked (chunks of 7
    positions) and on whole logits, its value and the student's gradients equal `hand_kd` on the two models'
    logits; the teacher gets no gradient."""
    student, teacher = tiny_models(dict(lm_head_bias=True, final_logit_softcapping=15.0))
    x = torch.randint(0, 4096, (2, 12))
    y = torch.randint(0, 4096, (2, 12))
    y[0, :5] = IGNORE
    kd = KDArgs(name, temperature=2.5, alpha=alpha)
    losses = distillation_loss_function(teacher, kd, chunk_size=7, chunked=chunked)(student, x, y)
    grads = torch.autograd.grad(losses["loss"], list(student.parameters()))
    expected, kd_part, ce_part = hand_kd(student(x).double(), teacher(x).double(), y, name, 2.5, alpha)
    expected_grads = torch.autograd.grad(expected, list(student.parameters()))
    assert set(losses) == {"loss", "kd_loss", "ce_loss"}
    torch.testing.assert_close(losses["loss"].double(), expected.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(losses["kd_loss"].double(), kd_part, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(losses["ce_loss"].double(), ce_part, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-6)
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())


class GPTWithRouterLoss(GPT):
    """A stand-in for a mixture-of-experts model (plumbing only): its "router loss" is a differentiable function of
    its weights."""

    def router_aux_loss(self):
        return 0.01 * self.transformer.h[0].mlp.fc_1.weight.square().sum()


@pytest.mark.parametrize("distill", [False, True])
def test_a_router_aux_loss_is_added_and_reported(distill):
    """Plumbing only (the MoE model brings the real one): a model's `router_aux_loss` is added to the loss, with its
    gradient, and reported as `aux_loss` beside `ce_loss`; a model without one gets the loss alone."""
    torch.manual_seed(0)
    student = GPTWithRouterLoss(Config(**STUDENT))
    student.init_weights()
    plain = GPT(Config(**STUDENT))
    plain.load_state_dict(student.state_dict())
    _, teacher = tiny_models()
    x, y = torch.randint(0, 4096, (2, 8)), torch.randint(0, 4096, (2, 8))
    function = (distillation_loss_function(teacher, KDArgs(alpha=0.5), chunk_size=5) if distill
                else loss_function("cross_entropy", chunk_size=5))
    losses, plain_losses = function(student, x, y), function(plain, x, y)
    aux = student.router_aux_loss()
    assert aux > 0 and losses["aux_loss"] == aux and "aux_loss" not in plain_losses
    assert set(plain_losses) == ({"loss", "kd_loss", "ce_loss"} if distill else {"loss"})
    torch.testing.assert_close(losses["ce_loss"], plain_losses.get("ce_loss", plain_losses["loss"]))
    torch.testing.assert_close(losses["loss"], plain_losses["loss"] + aux)
    weight, plain_weight = student.transformer.h[0].mlp.fc_1.weight, plain.transformer.h[0].mlp.fc_1.weight
    (grad,) = torch.autograd.grad(losses["loss"], [weight])
    (plain_grad,) = torch.autograd.grad(plain_losses["loss"], [plain_weight])
    torch.testing.assert_close(grad, plain_grad + 0.02 * weight.detach())  # d(0.01 |w|^2)/dw


# ---- the command, end to end -----------------------------------------------------------------------------------------
def child_environment(**extra: str) -> dict:
    import os

    env = {k: v for k, v in os.environ.items()
           if k == "LITGPT_CPUINFO" or not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_", "LITGPT_"))}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def litgpt(*args, timeout: int = 600, **env) -> subprocess.CompletedProcess:
    """`python -m litgpt ARGS`, forked from a server that imported torch and Lightning once
    (tests/litgpt_forkserver.py)."""
    return run_litgpt(args, cwd=ROOT, env=child_environment(**env), timeout=timeout)


def schedule(steps: int, global_batch: int = 4, micro: int = 1, lr: float = 0.003) -> list:
    """Flags of a short run on the bundled tiny corpus (seq 64; Adam's eps 1e-6, as tests/test_distributed.py says
    why, so that two world sizes stay comparable)."""
    return [
        "--train.max_steps", steps, "--train.global_batch_size", global_batch, "--train.micro_batch_size", micro,
        "--train.max_seq_length", 64, "--train.lr_warmup_steps", 1, "--train.log_interval", 1,
        "--train.max_norm", 1.0, "--eval.interval", 1000, "--eval.max_iters", 2, "--optimizer.class_path",
        "torch.optim.AdamW", "--optimizer.init_args.lr", lr, "--optimizer.init_args.eps", 1e-6, "--compiler", "none",
    ]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """A random student checkpoint, and a random teacher made confident (its head scaled up: a KD term far from 0)."""
    from litgpt.io import save_state_dict

    root = tmp_path_factory.mktemp("distill")
    Config(**TEACHER).save(root / "teacher.yaml")
    Config(**STUDENT).save(root / "student.yaml")
    teacher = write_random_checkpoint(root / "teacher", Config(**TEACHER), seed=1)
    weights = load_state_dict(teacher / "lit_model.pth")
    save_state_dict({k: v * 20 if k == "lm_head.weight" else v for k, v in weights.items()}, teacher / "lit_model.pth")
    student = write_random_checkpoint(root / "student", Config(**STUDENT), seed=2)
    texts = root / "texts"  # 60 stories of the bundled corpus: quick to tokenize
    texts.mkdir()
    for i, story in enumerate((TINY_DIR / "train.txt").read_text().split("\n\n")[:60]):
        (texts / f"{i:03d}.txt").write_text(story)
    data = ["--data", "TextFiles", "--data.train_data_path", texts, "--data.cache_dir", root / "cache"]
    tiny = ["--data", "Tiny", "--data.cache_dir", root / "tiny-cache"]
    return {"root": root, "teacher": teacher, "student": student, "data": data, "tiny": tiny}


@pytest.fixture(scope="module")
def trained_teacher(world) -> Path:
    """A teacher trained briefly by `litgpt pretrain` on the bundled corpus."""
    out_dir = world["root"] / "teacher_run"
    p = litgpt("pretrain", "--model_config", world["root"] / "teacher.yaml", "--tokenizer_dir", TINY_DIR / "tokenizer",
               "--out_dir", out_dir, *world["tiny"], *schedule(50, 8, 8, lr=0.01), "--train.save_interval", 1000)
    assert p.returncode == 0, p.stderr
    return out_dir / "final"


def distill_args(world: dict, out_dir: Path, steps: int = 4, *extra) -> list:
    return ["distill", world["student"], "--teacher_dir", world["teacher"], "--out_dir", out_dir, *world["data"],
            *schedule(steps), "--train.save_interval", 2, "--seed", 5, "--kd.loss", "js", "--kd.temperature", 2.0,
            "--kd.alpha", 0.5, *extra]


def logged(out_dir: Path) -> list[dict]:
    (log,) = Path(out_dir).rglob("metrics.csv")
    with open(log) as f:
        return [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(f) if row.get("loss")]


def assert_same_run(run: Path, reference: Path, loss_atol: float, weight_atol: float) -> None:
    """Two distillation runs of 4 steps log the same losses (both parts) and end with the same student weights."""
    ours, theirs = logged(run), logged(reference)
    assert len(ours) == len(theirs) == 4
    for name in ("loss", "kd_loss", "ce_loss"):
        torch.testing.assert_close(torch.tensor([r[name] for r in ours]), torch.tensor([r[name] for r in theirs]),
                                   rtol=0, atol=loss_atol)
    a, b = (load_state_dict(path / "final" / "lit_model.pth") for path in (run, reference))
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=weight_atol, msg=key)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def distilled(world) -> Path:
    """One process, 4 steps, checkpoints at steps 2 and 4."""
    before = digest(world["teacher"] / "lit_model.pth")
    out_dir = world["root"] / "distilled"
    p = litgpt(*distill_args(world, out_dir))
    assert p.returncode == 0, p.stderr
    assert digest(world["teacher"] / "lit_model.pth") == before
    return out_dir


@pytest.mark.slow  # a whole distill run through the CLI: with the whole suite (CI)
def test_the_run_logs_both_losses_and_saves_the_student_alone(world, distilled):
    rows = logged(distilled)
    assert len(rows) == 4
    for row in rows:  # the logged loss is 0.5 KD + 0.5 CE, both parts logged (at T 2, the KD term is not 0)
        assert row["kd_loss"] > 0.5 and row["ce_loss"] > 1
        assert abs(row["loss"] - (0.5 * row["kd_loss"] + 0.5 * row["ce_loss"])) < 1e-4
    metrics = json.loads((distilled / "metrics.json").read_text())
    assert abs(metrics["kd_loss"] - rows[-1]["kd_loss"]) < 1e-5 and abs(metrics["ce_loss"] - rows[-1]["ce_loss"]) < 1e-5
    assert metrics["val_loss"] > 1 and metrics["val_kd_loss"] > 0.5  # the student's cross-entropy, and the KD term

    student = GPT(Config(**STUDENT))
    shapes = {key: value.shape for key, value in student.state_dict().items()}
    for folder in ("step-000002", "final"):
        saved = load_state_dict(distilled / folder / "lit_model.pth")
        assert {key: value.shape for key, value in saved.items()} == shapes  # the student, nothing of the teacher
    optimizer = torch.load(distilled / "step-000002" / "training_state.pth", weights_only=True)["optimizer"]
    assert set(optimizer["state"]) == {name for name, _ in student.named_parameters()}
    p = litgpt("generate", distilled / "final", "--prompt", "Once upon a time", "--max_new_tokens", 5)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().startswith("Once upon a time")


@pytest.mark.slow
def test_two_fully_sharded_processes_equal_one(world, distilled):
    """The student and the teacher sharded over 2 processes: the same losses (1e-5) and weights (1e-4)."""
    out_dir = world["root"] / "two"
    p = litgpt(*distill_args(world, out_dir), "--devices", 2, "--fsdp.sharding_strategy", "FULL_SHARD")
    assert p.returncode == 0, p.stderr
    assert_same_run(out_dir, distilled, loss_atol=1e-5, weight_atol=1e-4)
    assert json.loads((out_dir / "metrics.json").read_text())["sharding_strategy"] == "FULL_SHARD"


@pytest.mark.slow
def test_a_tensor_parallel_student_and_teacher_distill_as_one_process(world, distilled):
    """Both models split over 2 processes (--parallel.tensor 2): the loss runs on each rank's vocabulary rows of both
    heads, with the losses (both parts) and weights of one process."""
    out_dir = world["root"] / "tp2"
    p = litgpt(*distill_args(world, out_dir), "--devices", 2, "--parallel.tensor", 2)
    assert p.returncode == 0, p.stderr
    assert_same_run(out_dir, distilled, loss_atol=1e-5, weight_atol=1e-4)


@pytest.mark.slow
def test_a_pipelined_student_distills_as_one_process(world):
    """--parallel.pipeline 2 cuts a 2-layer student into 2 stages; the teacher runs whole where the last stage's loss
    reads it: the losses (both parts) and weights of one process."""
    student = write_random_checkpoint(world["root"] / "student-2", Config(**{**STUDENT, "n_layer": 2}), seed=2)
    runs = {}
    for name, flags in (("one", []), ("pp2", ["--devices", 2, "--parallel.pipeline", 2])):
        runs[name] = world["root"] / f"pipelined-{name}"
        args = distill_args(world, runs[name], 4, *flags)
        args[1] = student
        p = litgpt(*args)
        assert p.returncode == 0, p.stderr
    assert_same_run(runs["pp2"], runs["one"], loss_atol=1e-5, weight_atol=1e-4)


@pytest.mark.slow
def test_the_optimizer_in_the_backward_pass_distills_as_the_optimizer_after_it(world):
    """--train.optimizer_in_backward (one micro-batch of 4 per step, no clipping) steps the student alone, the
    frozen teacher having no gradient: the losses and weights of the optimizer stepped after the backward pass."""
    one_micro_batch = ["--train.micro_batch_size", 4, "--train.max_norm", "null"]
    runs = {}
    for name, flags in (("after", []), ("in_backward", ["--train.optimizer_in_backward", "true"])):
        runs[name] = world["root"] / f"optimizer-{name}"
        p = litgpt(*distill_args(world, runs[name], 4, *one_micro_batch, *flags))
        assert p.returncode == 0, p.stderr
    assert_same_run(runs["in_backward"], runs["after"], loss_atol=1e-6, weight_atol=1e-6)


@pytest.mark.slow
def test_a_killed_run_resumes_bit_exact(world, distilled):
    """Killed after step 3 (the last checkpoint is step 2), then `--resume auto`: the teacher is read again from its
    folder and the run ends with the uninterrupted run's weights, bit for bit."""
    out_dir = world["root"] / "killed"
    p = litgpt(*distill_args(world, out_dir), LITGPT_FAILPOINT="step:end@3", LITGPT_FAILPOINTS_ARMED="1")
    assert p.returncode != 0 and not (out_dir / "final").exists()
    p = litgpt(*distill_args(world, out_dir), "--resume", "auto")
    assert p.returncode == 0, p.stderr
    assert "Resuming from " in p.stdout and "step-000002" in p.stdout
    ours, theirs = (load_state_dict(run / "final" / "lit_model.pth") for run in (out_dir, distilled))
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key


def kl_to_teacher(teacher_dir: Path, student_dir: Path) -> float:
    """Mean KL(teacher || student) over the positions of 32 validation stories (64 tokens each), in float64."""
    def load(folder: Path) -> GPT:
        model = GPT(Config.from_checkpoint(folder))
        model.load_state_dict(load_state_dict(folder / "lit_model.pth"))
        return model.eval()

    tokenizer = Tokenizer(teacher_dir)
    stories = (TINY_DIR / "val.txt").read_text().split("\n\n")
    ids = torch.stack([ids[:64] for ids in map(tokenizer.encode, stories[:48]) if len(ids) >= 64][:32])
    with torch.no_grad():
        log_p = torch.log_softmax(load(teacher_dir)(ids).double(), dim=-1)
        log_q = torch.log_softmax(load(student_dir)(ids).double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()


@pytest.mark.slow
def test_a_distilled_student_is_closer_to_its_teacher_than_one_trained_on_the_labels(world, trained_teacher):
    """The same random student (same config and seed), 30 steps on the bundled corpus: distilled (pure forward KL)
    vs pretrained with cross-entropy; the KL to the teacher, computed here in plain PyTorch, is clearly lower."""
    runs = {"kd": world["root"] / "kl-kd", "ce": world["root"] / "kl-ce"}
    same = ["--model_config", world["root"] / "student.yaml", *world["tiny"], *schedule(30, 8, 8, lr=0.01),
            "--train.save_interval", 1000, "--seed", 7]
    p = litgpt("distill", "--teacher_dir", trained_teacher, "--out_dir", runs["kd"], *same)
    assert p.returncode == 0, p.stderr
    p = litgpt("pretrain", "--tokenizer_dir", trained_teacher, "--out_dir", runs["ce"], *same)
    assert p.returncode == 0, p.stderr
    kl = {name: kl_to_teacher(trained_teacher, out_dir / "final") for name, out_dir in runs.items()}
    print(f"KL(teacher || student) on validation tokens: {kl}")
    assert kl["kd"] < 0.8 * kl["ce"], kl


# ---- bad input: one line, exit code 1, nothing on disk changed -------------------------------------------------------
@pytest.fixture(scope="module")
def bad_world(tmp_path_factory) -> Path:
    """A good student and teacher, and teachers that cannot teach it (random weights: every case fails first)."""
    import shutil

    import yaml

    root = tmp_path_factory.mktemp("distill_bad")
    write_random_checkpoint(root / "student", Config(**STUDENT))
    teacher = write_random_checkpoint(root / "teacher", Config(**TEACHER))

    def variant(name: str, **config_changes) -> Path:
        folder = root / name
        shutil.copytree(teacher, folder)
        values = {**yaml.safe_load((folder / "model_config.yaml").read_text()), **config_changes}
        (folder / "model_config.yaml").write_text(yaml.safe_dump(values))
        return folder

    (variant("no_weights") / "lit_model.pth").unlink()
    (variant("no_config") / "model_config.yaml").unlink()
    variant("other_vocab", vocab_size=4000)
    variant("other_padding", padded_vocab_size=4160)
    variant("short", block_size=32)
    tokenizer = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = list(vocab)[300], list(vocab)[301]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # the same tokens and size, two ids swapped
    (variant("other_tokenizer") / "tokenizer.json").write_text(json.dumps(tokenizer))
    return root


def folder_digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        h.update(str(path.relative_to(root)).encode())
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


BAD_INPUT = [
    ("no_weights", [], "--teacher_dir: '{root}/no_weights' has no lit_model.pth"),
    ("other_vocab", [], "The student's vocab_size is 4096 but the teacher's"),
    ("other_tokenizer", [], "differ: 2 token(s) have another id or are missing in one"),
    ("teacher", ["--kd.loss", "kl"],
     "--kd.loss 'kl' is not a distillation loss: use one of forward_kl, reverse_kl, js"),
    ("teacher", ["--kd.alpha", "1.5"], "--kd.alpha 1.5 is outside [0, 1]"),
    ("teacher", ["--kd.temperature", "0"], "--kd.temperature 0.0 must be a finite number above 0"),
    ("no_config", [], "has no model_config.yaml"),
    ("other_padding", [], "The student's padded_vocab_size is 4096 but the teacher's"),
    ("short", [], "longer than the teacher's block size 32"),
    ("teacher", ["--kd.alpha", "-0.1"], "--kd.alpha -0.1 is outside [0, 1]"),
    ("teacher", ["--kd.temperature", "-1"], "--kd.temperature -1.0 must be"),
    ("missing", [], "--teacher_dir: Checkpoint folder '{root}/missing' does not exist"),
    ("teacher", ["--model_config", "{root}/student/model_config.yaml"], "not both"),
]


@pytest.mark.parametrize("teacher, flags, message", BAD_INPUT)
def test_bad_input_is_one_line(bad_world, teacher, flags, message, capsys):
    before = folder_digest(bad_world)
    flags = [flag.format(root=bad_world) for flag in flags]
    lines = distill_error(bad_world / "student", "--teacher_dir", bad_world / teacher, "--out_dir", bad_world / "out",
                          "--train.max_steps", 1, *flags, capsys=capsys)
    assert len(lines) == 1, lines
    assert lines[0].startswith("litgpt distill: error: ") and message.format(root=bad_world) in lines[0], lines[0]
    assert folder_digest(bad_world) == before


def test_no_student_or_no_teacher_is_one_line(bad_world, capsys):
    for args, message in (([], "Give the student"), ([bad_world / "student"], "--teacher_dir")):
        teacher = [] if args else ["--teacher_dir", bad_world / "teacher"]
        lines = distill_error(*args, *teacher, "--out_dir", bad_world / "out", capsys=capsys)
        assert len(lines) == 1 and message in lines[0], lines


def distill_error(*args, capsys) -> list[str]:
    """The lines `litgpt distill ARGS` writes to stderr, run in this process (bad input stops it before any heavy
    work); it must exit with code 1, and any other exception (a traceback) fails the test."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["distill", *map(str, args)])
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 1, stderr
    return stderr.strip().splitlines()


# ---- the teacher on its devices --------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision, dtype", [("32-true", torch.float32), ("bf16-mixed", torch.bfloat16),
                                              ("bf16-true", torch.bfloat16)])
def test_the_teacher_is_frozen_in_eval_mode_in_the_compute_dtype_with_its_weights(tmp_path, precision, dtype):
    from litgpt.distributed.fabric import build_fabric
    from litgpt.precision import Precision
    from litgpt.train.recipe import Recipe
    from litgpt.train.recipes.distill import DistillRecipe, TeacherSettings

    folder = write_random_checkpoint(tmp_path / "teacher", Config(**TEACHER), seed=3)
    teacher_settings = TeacherSettings(Config(**TEACHER), folder / "lit_model.pth", KDArgs())
    recipe = DistillRecipe(name="distill", config=Config(**STUDENT), teacher=teacher_settings)
    precision = Precision(precision)
    (name, teacher), = recipe.materialize_frozen(build_fabric(1, 1, precision), precision, False).items()
    assert name == "teacher"
    assert not teacher.training
    assert all(not p.requires_grad and p.dtype == dtype for p in teacher.parameters())
    saved = load_state_dict(folder / "lit_model.pth")
    assert teacher.state_dict().keys() == saved.keys()
    for key, value in teacher.state_dict().items():
        assert torch.equal(value, saved[key].to(dtype)), key
    assert Recipe(name="pretrain", config=Config(**STUDENT)).materialize_frozen(None, precision, False) == {}


@pytest.mark.slow
def test_each_rank_holds_half_of_a_fully_sharded_teacher(world, tmp_path):
    """A 25M-parameter teacher of 32 small blocks beside a tiny student on 2 processes: each rank's peak RSS under
    FULL_SHARD is lower than under NO_SHARD by about half the teacher's float32 weights, less what stays or is
    gathered (the root, embeddings and head, and a block or two at a time: about a quarter of that half here), plus
    the pages of the memory-mapped teacher file that a rank does not read (NO_SHARD reads all of them, FULL_SHARD its
    half). A teacher left whole on every rank would save nothing."""
    config = Config(**{**TEACHER, "n_layer": 32, "n_embd": 256, "intermediate_size": 688})  # blocks of 0.8M
    teacher = write_random_checkpoint(tmp_path / "teacher", config)
    parameters = sum(t.numel() for t in load_state_dict(teacher / "lit_model.pth").values())
    # glibc keeps freed memory unless told to return it; without this RSS hides what sharding saves.
    env = dict(GLIBC_TUNABLES="glibc.malloc.mmap_threshold=65536:glibc.malloc.trim_threshold=0")
    peaks = {}
    for strategy in ("NO_SHARD", "FULL_SHARD"):
        out_dir = tmp_path / strategy
        args = distill_args(world, out_dir, 2)
        args[args.index("--teacher_dir") + 1] = teacher
        p = litgpt(*args, "--devices", 2, "--fsdp.sharding_strategy", strategy, "--fsdp.state_dict_type", "sharded",
                   **env)
        assert p.returncode == 0, p.stderr
        peaks[strategy] = json.loads((out_dir / "metrics.json").read_text())["peak_memory_mb_per_rank"]
    half = 4 * parameters / 2 / 2**20  # float32 (32-true on the CPU), half on each of two ranks
    saving = peaks["NO_SHARD"][1] - peaks["FULL_SHARD"][1]
    print(f"teacher {parameters:,} parameters: half its weights {half:.1f} MB, saved per rank {saving:.1f} MB")
    assert 0.6 * half < saving < 2.2 * half, (peaks, half)


def test_the_plan_counts_the_teacher():
    """`litgpt plan` with a teacher: its weights in 16 bits (bf16-mixed), every weight's shard over 2 devices plus
    the final norm and head gathered (the embedding, a unit of its own, is resharded after each forward pass), its
    final hidden states, and its chunk of logits with the KD buffers."""
    from litgpt.checkpoint.model_files import meta_device
    from litgpt.args import FSDPArgs, ParallelArgs, TrainArgs
    from litgpt.plan import format_plan, plan_for

    settings = dict(precision="bf16-mixed", fsdp=FSDPArgs(sharding_strategy="FULL_SHARD"), devices=2,
                    train=TrainArgs(micro_batch_size=2, max_seq_length=64), device="cpu")
    alone = plan_for(Config(**STUDENT), **settings)
    distilling = plan_for(Config(**STUDENT), **settings, teacher_config=Config(**TEACHER))
    with meta_device():
        teacher = GPT(Config(**TEACHER))
    shards = sum(math.ceil(p.shape[0] / 2) * p[0].numel() for p in teacher.parameters())
    root = sum(p.numel() for name, p in teacher.named_parameters()
               if not name.startswith(("transformer.h.", "transformer.wte.")))
    weights = 2 * (shards + root)
    assert distilling.teacher_bytes == weights and distilling.teacher_params == 598_336
    at_peak = {key: distilling.at_peak[key] - alone.at_peak[key] for key in alone.at_peak}
    assert distilling.peak_phase == alone.peak_phase == "start of the backward pass"
    assert at_peak["parameters"] == weights
    assert at_peak["activations"] == 2 * 64 * 64 * 2  # the teacher's hidden states, bf16
    assert at_peak["logits_loss"] == 128 * 4096 * (2 + 4 + 3 * 4)  # one chunk of all 128 positions
    text = format_plan(distilling)
    assert "distilled from a frozen 598.34 K-parameter teacher" in text and "Distillation: the frozen teacher" in text
    # Under --parallel.tensor 2 the teacher is split as the student is: half of its parameters (each layer's heads,
    # MLP columns and vocabulary rows; the norms whole) and its chunk of logits over half of the vocabulary.
    split = plan_for(Config(**STUDENT), **{**settings, "fsdp": FSDPArgs(sharding_strategy="NO_SHARD")},
                     teacher_config=Config(**TEACHER), parallel=ParallelArgs(tensor=2))
    norms = sum(p.numel() for p in teacher.parameters() if p.dim() == 1)  # the norms (no biases)
    assert split.teacher_params == (598_336 - norms) // 2 + norms
    alone_split = plan_for(Config(**STUDENT), **{**settings, "fsdp": FSDPArgs(sharding_strategy="NO_SHARD")},
                           parallel=ParallelArgs(tensor=2))
    assert split.at_peak["logits_loss"] - alone_split.at_peak["logits_loss"] == 128 * 4096 // 2 * (2 + 4 + 3 * 4)
