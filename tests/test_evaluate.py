"""`litgpt evaluate`: lm-evaluation-harness on our GPT, checked against plain log-softmaxes of the model's logits.

Offline: the tasks are written here, a multiple-choice and a generate_until task on a local JSONL file, and reached
with --include_path; the model is a random tiny checkpoint with a Llama-style tokenizer.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from litgpt.__main__ import main as litgpt_main  # noqa: E402
from litgpt.chat_template import ChatFormat  # noqa: E402
from litgpt.errors import UserError  # noqa: E402
from litgpt.evaluate import find_tasks  # noqa: E402
from litgpt.evaluation.harness import HarnessModel  # noqa: E402
from litgpt.generate import load_model_and_tokenizer  # noqa: E402
from litgpt_forkserver import run_litgpt  # noqa: E402
from ports import free_port  # noqa: E402
from test_generate import write_lit_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DOCS = [
    {"question": "The sky is", "choices": ["blue", "green", "loud"], "label": 0, "answer": "blue"},
    {"question": "Fire is", "choices": ["cold", "hot", "square"], "label": 1, "answer": "hot"},
    {"question": "Grass is", "choices": ["green", "purple", "sad"], "label": 0, "answer": "green"},
    {"question": "Snow is", "choices": ["black", "loud", "white"], "label": 2, "answer": "white"},
]

TASKS = {
    "tiny_mc.yaml": """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
fewshot_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""",
    "tiny_gen.yaml": """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
fewshot_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: " {{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""",
    "tiny_all.yaml": """group: tiny_all
task: [tiny_mc, tiny_gen]
aggregate_metric_list:
  - metric: acc
""",
}


@pytest.fixture(scope="module", autouse=True)
def offline(tmp_path_factory):
    """No hub, and the datasets cache in a scratch folder (both read when `datasets` is first imported)."""
    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_DATASETS_CACHE")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                      HF_DATASETS_CACHE=str(tmp_path_factory.mktemp("datasets_cache")))
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_lit_checkpoint(tmp_path_factory.mktemp("evaluate") / "tiny", "llama", block_size=32)


@pytest.fixture(scope="module")
def task_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tasks")
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    for name, text in TASKS.items():
        (folder / name).write_text(text.format(data=data))
    return folder


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_model_and_tokenizer(checkpoint, precision="32-true", device="cpu")


@torch.inference_mode()
def plain_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context) from one forward pass of the whole text and a float64 log-softmax."""
    context_ids = tokenizer.encode(context).tolist()
    whole = tokenizer.encode(context + continuation).tolist()
    assert whole[: len(context_ids)] == context_ids
    n = len(whole) - len(context_ids)  # the continuation's tokens: the last n
    whole = whole[-(model.config.block_size + 1):]  # the harness's left truncation
    logprobs = model(torch.tensor([whole[:-1]])).double().log_softmax(-1)[0]
    return sum(logprobs[len(whole) - 1 - n + i, whole[len(whole) - n + i]].item() for i in range(n))


def requests(kind: str, arguments: list[tuple]):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=args, idx=0) for args in arguments]


@pytest.mark.parametrize("overrides", [{}, {"final_logit_softcapping": 4.0}], ids=["plain", "softcapping"])
def test_loglikelihoods_equal_a_plain_log_softmax(tmp_path, overrides):
    model, tokenizer = load_model_and_tokenizer(
        write_lit_checkpoint(tmp_path / "tiny", "llama", block_size=32, **overrides), precision="32-true", device="cpu"
    )
    long_context = " ".join(["the cat sat on the mat"] * 12)  # longer than the block size: cut from the left
    pairs = [(doc["question"], f" {choice}") for doc in DOCS for choice in doc["choices"]] + [(long_context, " ok")]
    assert len(tokenizer.encode(long_context)) > model.config.block_size
    expected = [plain_loglikelihood(model, tokenizer, c, x) for c, x in pairs]
    for batch_size in (1, 2, 5):
        scores = HarnessModel(model, tokenizer, batch_size=batch_size).loglikelihood(requests("loglikelihood", pairs))
        assert [s for s, _ in scores] == pytest.approx(expected, abs=1e-4)


@torch.inference_mode()
def plain_greedy(model, tokenizer, context: str, new_tokens: int) -> str:
    """Greedy decoding by recomputing every step on the whole sequence, no KV cache, up to EOS: the new text."""
    prompt = tokenizer.encode(context).tolist()
    ids = list(prompt)
    for _ in range(min(new_tokens, model.config.block_size - len(prompt))):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        if ids[-1] == tokenizer.eos_id:
            ids.pop()
            break
    return tokenizer.decode(ids[len(prompt):])


def test_generate_until_equals_plain_greedy_decoding(loaded):
    model, tokenizer = loaded
    context, other = "Q: The sky is\nA:", "Q: Fire is\nA:"
    full = plain_greedy(model, tokenizer, context, 8)
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"pick a visible stop string in {full!r}"
    arguments = [(context, {"until": [stop], "max_gen_toks": 8}), (other, {"until": ".", "max_gen_toks": 12}),
                 (context, {"until": ["\x00"], "max_gen_toks": 8})]
    expected = [full[: full.index(stop)], plain_greedy(model, tokenizer, other, 12).split(".")[0], full]
    for batch_size in (1, 3):  # the two prompts of one length are decoded together with batch size 3
        model_ = HarnessModel(model, tokenizer, batch_size=batch_size)
        assert model_.generate_until(requests("generate_until", arguments)) == expected


def test_sampling_options_are_honoured_and_seeded(loaded):
    """Sampled answers repeat with the seed (at any batch size) and change with another; temperature 0, top_k 1
    and a tiny top_p leave only the most likely token: plain greedy decoding."""
    model, tokenizer = loaded
    contexts = ["Q: The sky is\nA:", "Q: Fire is\nA:", "Q: Snow is\nA:"]
    sampled = {"do_sample": True, "temperature": 2.0, "until": ["\x00"], "max_gen_toks": 8}

    def answers(seed: int, batch_size: int, options: dict) -> list[str]:
        lm = HarnessModel(model, tokenizer, batch_size=batch_size, seed=seed)
        return lm.generate_until(requests("generate_until", [(c, dict(options)) for c in contexts]))

    first = answers(1, 1, sampled)
    assert answers(1, 3, sampled) == first
    assert answers(2, 1, sampled) != first
    greedy = [plain_greedy(model, tokenizer, context, 8) for context in contexts]
    assert first != greedy
    for options in ({}, {"temperature": 0.0}, {"do_sample": True, "temperature": 0.0}, {"temperature": 0.7,
                    "do_sample": False}, {"do_sample": True, "top_k": 1}, {"do_sample": True, "top_p": 1e-6}):
        assert answers(1, 2, {**options, "until": ["\x00"], "max_gen_toks": 8}) == greedy, options
    with pytest.raises(UserError, match="num_beams"):
        answers(1, 1, {"num_beams": 4, "max_gen_toks": 8})


def test_task_names_with_wildcards(task_folder):
    """A pattern stands for the names fnmatch finds among the folder's tasks and groups; a plain name for itself."""
    written = ["tiny_mc", "tiny_gen", "tiny_all"]
    assert find_tasks(["tiny_*"], task_folder)[1] == sorted(fnmatch.filter(written, "tiny_*"))
    assert find_tasks(["tiny_gen", "tiny_m?"], task_folder)[1] == ["tiny_gen", "tiny_mc"]


def test_tasks_from_include_path(checkpoint, task_folder, loaded, tmp_path):
    """Zero-shot accuracy is the argmax of plain loglikelihoods; batch sizes 1, 2 and auto give the same results."""
    results = {}
    for batch_size in ("1", "2", "auto"):
        out = tmp_path / f"bs{batch_size}"
        litgpt_main(["evaluate", str(checkpoint), "--tasks", "tiny_m*,tiny_gen", "--include_path", str(task_folder),
                     "--num_fewshot", "0", "--limit", "3", "--batch_size", batch_size, "--device", "cpu",
                     "--precision", "32-true", "--out_dir", str(out)])
        results[batch_size] = json.loads((out / "results.json").read_text())
    assert results["1"]["results"] == results["2"]["results"] == results["auto"]["results"]
    assert results["2"]["batch_size"] == 2 and 1 <= results["auto"]["batch_size"] <= 64
    assert results["1"]["n-shot"] == {"tiny_mc": 0, "tiny_gen": 0}
    assert results["1"]["n-samples"]["tiny_mc"]["effective"] == 3
    model, tokenizer = loaded
    hits = [
        max(range(3), key=lambda i: plain_loglikelihood(model, tokenizer, doc["question"], f" {doc['choices'][i]}"))
        == doc["label"]
        for doc in DOCS[:3]
    ]
    assert results["1"]["results"]["tiny_mc"]["acc,none"] == pytest.approx(sum(hits) / 3)
    assert 0 <= results["1"]["results"]["tiny_gen"]["exact_match,none"] <= 1


@pytest.mark.slow  # a second harness run through the CLI: with the whole suite (CI)
def test_one_shot_group(checkpoint, task_folder, tmp_path):
    runs = []
    for batch_size in (1, 2):
        litgpt_main(["evaluate", str(checkpoint), "--tasks", "tiny_all", "--include_path", str(task_folder),
                     "--num_fewshot", "1", "--limit", "4", "--batch_size", str(batch_size), "--device", "cpu",
                     "--out_dir", str(tmp_path / str(batch_size))])
        runs.append(json.loads((tmp_path / str(batch_size) / "results.json").read_text()))
    assert runs[0]["n-shot"] == {"tiny_all": 1, "tiny_mc": 1, "tiny_gen": 1}
    assert runs[0]["results"] == runs[1]["results"]
    assert runs[0]["groups"]["tiny_all"]["acc,none"] == runs[0]["results"]["tiny_mc"]["acc,none"]


def test_perplexity_equals_exp_mean_nll_by_hand(checkpoint, loaded, tmp_path):
    model, tokenizer = loaded
    text_file = tmp_path / "text.txt"
    text_file.write_text("Once upon a time a small llama found a red ball in the garden and played all day long.\n" * 2)
    tokens = tokenizer.encode(text_file.read_text(), bos=False, eos=False).tolist()
    block = model.config.block_size
    assert len(tokens) > 2 * block
    # Every token predicted from as many tokens before it as fit, the first from BOS: stride 1 gives exactly this.
    sequence = [tokenizer.bos_id] + tokens
    with torch.inference_mode():
        nll = -sum(
            model(torch.tensor([sequence[max(0, j - block) : j]]))[0, -1].double().log_softmax(-1)[sequence[j]].item()
            for j in range(1, len(sequence))
        )
    out = tmp_path / "out"
    litgpt_main(["evaluate", str(checkpoint), "--perplexity", str(text_file), "--stride", "1", "--batch_size", "4",
                 "--device", "cpu", "--out_dir", str(out)])
    report = json.loads((out / "results.json").read_text())["perplexity"]
    assert report["tokens"] == len(tokens) and report["stride"] == 1 and report["max_length"] == block
    assert report["mean_nll"] == pytest.approx(nll / len(tokens), abs=1e-5)
    assert report["perplexity"] == pytest.approx(math.exp(nll / len(tokens)), rel=1e-5)


def test_bad_input_is_one_line(checkpoint, task_folder, tmp_path, capsys):
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00text")
    hub_task = tmp_path / "hub_task"  # a task whose data are on the hub, which is not reachable offline
    hub_task.mkdir()
    (hub_task / "hub_task.yaml").write_text(
        "task: hub_task\ndataset_path: nobody/no_such_dataset\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{q}}'\ndoc_to_choice: ['a', 'b']\ndoc_to_target: 0\nmetric_list:\n  - metric: acc\n"
    )
    cases = [
        (["evaluate", str(tmp_path / "nowhere"), "--tasks", "tiny_mc"], "does not exist"),
        (["evaluate", str(checkpoint)], "--tasks"),
        (["evaluate", str(checkpoint), "--perplexity", str(tmp_path / "none.txt")], "is not a file"),
        (["evaluate", str(checkpoint), "--perplexity", str(binary)], "not UTF-8"),
        (["evaluate", str(checkpoint), "--tasks", "tiny_mc", "--include_path", str(tmp_path / "no")], "not a folder"),
        (["evaluate", str(checkpoint), "--tasks", "tiny_mc", "--batch_size", "0"], "--batch_size"),
        (["evaluate", str(checkpoint), "--tasks", "hub_task", "--include_path", str(hub_task)], "HF_HUB_OFFLINE"),
    ]
    for argv, words in cases:
        with pytest.raises(SystemExit) as exit_info:
            litgpt_main(argv)
        assert exit_info.value.code == 1
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1, err
    assert not (checkpoint / "evaluate").exists()


@pytest.mark.slow  # indexing lm-eval's own tasks, where a name not in --include_path is looked for, takes seconds
def test_unknown_task_is_one_line(checkpoint, task_folder, capsys):
    with pytest.raises(SystemExit) as exit_info:
        litgpt_main(["evaluate", str(checkpoint), "--tasks", "tiny_mc,tiny_mcq", "--include_path",
                     str(task_folder)])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "'tiny_mcq'" in err and "--include_path" in err and "close: tiny_mc" in err
    assert not (checkpoint / "evaluate").exists()


@pytest.mark.slow  # converts the checkpoint and loads it in transformers
def test_equals_lm_evals_transformers_model(checkpoint, task_folder, loaded, tmp_path):
    """lm-eval's own HFLM on the convert_from_litgpt copy (`--backend hf`) is the reference: the same task results,
    loglikelihoods and generations; rolling loglikelihoods condition on the BOS token once (HFLM's tokenizer would
    add a second one after its prefix token, hence add_bos_token=False there)."""
    from lm_eval.models.huggingface import HFLM

    results = {}
    for backend in ("litgpt", "hf"):
        litgpt_main(["evaluate", str(checkpoint), "--tasks", "tiny_mc,tiny_gen", "--include_path", str(task_folder),
                     "--num_fewshot", "1", "--batch_size", "2", "--device", "cpu", "--precision", "32-true",
                     "--backend", backend, "--out_dir", str(tmp_path / backend)])
        results[backend] = json.loads((tmp_path / backend / "results.json").read_text())["results"]
    assert results["litgpt"] == results["hf"]

    model, tokenizer = loaded
    ours = HarnessModel(model, tokenizer, batch_size=2)
    hf_dir = str(tmp_path / "hf" / "hf_model")
    theirs = HFLM(pretrained=hf_dir, backend="causal", batch_size=2, device="cpu", dtype="float32")
    pairs = [("The sky is", " blue"), ("", "Fire is hot"), (" ".join(["the cat sat"] * 30), " on the mat")]
    expected = theirs.loglikelihood(requests("loglikelihood", pairs))
    actual = ours.loglikelihood(requests("loglikelihood", pairs))
    assert [s for s, _ in actual] == pytest.approx([s for s, _ in expected], abs=1e-4)
    assert [g for _, g in actual] == [g for _, g in expected]
    prompts = [("Q: The sky is\nA:", {"until": ["."], "max_gen_toks": 8}),
               ("Q: Fire is\nA:", {"until": "\n", "max_gen_toks": 8})]
    assert ours.generate_until(requests("generate_until", prompts)) == theirs.generate_until(
        requests("generate_until", prompts))
    text = [("Once upon a time a llama found a red ball. " * 6,)]
    no_second_bos = HFLM(pretrained=hf_dir, backend="causal", batch_size=2, device="cpu", dtype="float32",
                         add_bos_token=False)
    assert ours.loglikelihood_rolling(requests("loglikelihood_rolling", text)) == pytest.approx(
        no_second_bos.loglikelihood_rolling(requests("loglikelihood_rolling", text)), abs=1e-4)


def test_chat_template_lays_out_the_prompts_as_transformers_does(checkpoint, task_folder, tmp_path):
    """With --apply_chat_template lm-eval's prompts are the checkpoint's template rendered as transformers'
    `apply_chat_template` renders it (system instruction included), and the model reads them as its tokens."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    folder = shutil.copytree(checkpoint, tmp_path / "chat")
    template = (Path(__file__).parent / "chat_templates" / "llama-2-chat.jinja").read_text()
    (folder / "chat_template.jinja").write_text(template)
    model, tokenizer = load_model_and_tokenizer(folder, precision="32-true", device="cpu")
    lm = HarnessModel(model, tokenizer, batch_size=2,
                      chat_format=ChatFormat.from_checkpoint(folder, tokenizer, model.config))
    results = simple_evaluate(lm, tasks=["tiny_gen"], task_manager=TaskManager(include_path=str(task_folder),
                              include_defaults=False), num_fewshot=0, limit=2, log_samples=True,
                              apply_chat_template=True, system_instruction="Answer briefly.")
    hf = AutoTokenizer.from_pretrained(folder)
    for sample in results["samples"]["tiny_gen"]:
        messages = [{"role": "system", "content": "Answer briefly."},
                    {"role": "user", "content": f"Q: {sample['doc']['question']}\nA:"}]
        prompt = sample["arguments"][0][0]
        assert prompt == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert lm.tok_encode(prompt) == hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                               return_dict=True)["input_ids"]
    assert lm.chat_template(True) == template  # what lm-eval's trackers record of the run
    out = tmp_path / "out"  # the CLI runs it too
    litgpt_main(["evaluate", str(folder), "--tasks", "tiny_gen", "--include_path", str(task_folder), "--limit", "2",
                 "--apply_chat_template", "true", "--device", "cpu", "--out_dir", str(out)])
    assert "tiny_gen" in json.loads((out / "results.json").read_text())["results"]


@pytest.mark.slow  # two ranks that each import lm-eval and load the tasks: about 40 s on two shared cores
def test_two_processes_give_the_metrics_of_one(checkpoint, task_folder, tmp_path):
    """--devices 2 on CPUs (gloo): each process evaluates half the documents, rank 0 reports all of them."""
    arguments = ["evaluate", str(checkpoint), "--tasks", "tiny_mc,tiny_gen", "--include_path", str(task_folder),
                 "--num_fewshot", "1", "--batch_size", "2", "--device", "cpu", "--precision", "32-true"]
    litgpt_main([*arguments, "--out_dir", str(tmp_path / "one")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    run = run_litgpt([*arguments, "--devices", "2", "--out_dir", str(tmp_path / "two")], cwd=Path(__file__).parents[1],
                     env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    one, two = (json.loads((tmp_path / name / "results.json").read_text()) for name in ("one", "two"))
    assert two["n-samples"] == one["n-samples"] == {name: {"original": 4, "effective": 4}
                                                    for name in ("tiny_mc", "tiny_gen")}
    for task, metrics in one["results"].items():
        assert two["results"][task] == pytest.approx(metrics), task


