"""`litgpt distill`: train a student to match a frozen teacher's next-token distributions (knowledge distillation).

The run is pretraining's job with `litgpt.train.recipes.distill.DistillRecipe` as its recipe (the teacher, frozen,
beside the student; the loss `litgpt.train.loss.distillation_loss`); everything else (data, sharding, checkpoints,
resume, signals, metrics) is what every training command has.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Optional, Union

from litgpt.args import EvalArgs, FSDPArgs, ParallelArgs, KDArgs, LoggerArgs, TrainArgs
from litgpt.config import Config
from litgpt.data.base import DataModule
from litgpt.errors import UserError
from litgpt.loggers import LoggerName
from litgpt.pretrain import fsdp_for_strategy

if TYPE_CHECKING:
    from litgpt.train.job import Job


def setup(
    student_dir: Optional[Path] = None,
    teacher_dir: Optional[Path] = None,
    model_name: Optional[str] = None,
    model_config: Optional[Config] = None,
    out_dir: Path = Path("out/distill"),
    precision: Optional[str] = None,
    resume: Union[bool, Literal["auto"], Path] = False,
    data: Optional[DataModule] = None,
    train: TrainArgs = TrainArgs(
        save_interval=1000,
        log_interval=1,
        global_batch_size=128,
        micro_batch_size=2,
        lr_warmup_steps=100,
        epochs=1,
        max_norm=1.0,
    ),
    eval: EvalArgs = EvalArgs(interval=1000, max_iters=100),
    optimizer: Union[str, dict] = "AdamW",
    devices: Union[int, str] = "auto",
    num_nodes: int = 1,
    fsdp: FSDPArgs = FSDPArgs(),
    parallel: ParallelArgs = ParallelArgs(),
    tokenizer_dir: Optional[Path] = None,
    logger_name: LoggerName = "csv",
    logger: LoggerArgs = LoggerArgs(),
    seed: int = 42,
    profile: bool = False,
    compiler: str = "auto",
    strategy: Literal["auto", "fsdp", "ddp"] = "auto",
    kd: KDArgs = KDArgs(),
) -> None:
    """Distill a frozen teacher into a student.

    The loss is kd.alpha x KD + (1 - kd.alpha) x cross-entropy on the labels, both means over the labelled positions
    (a prompt masked by instruction data is ignored by both). The validation loss is the student's cross-entropy on
    the labels, comparable with the other commands' and with the teacher's.

    Args:
        student_dir: The student's checkpoint folder (lit_model.pth, model_config.yaml, tokenizer), or leave out and
            give --model_name / --model_config for a randomly initialized student.
        teacher_dir: The teacher's checkpoint folder. It must have the student's vocabulary and tokenizer. It is
            frozen, runs in the compute dtype and is sharded like the student; it is never saved.
        model_name: A registered model name for a randomly initialized student (`litgpt download list`).
        model_config: The randomly initialized student's config fields (in YAML under `model_config:`).
        out_dir: Where checkpoints (step-XXXXXX/, final/), logs, run_args.json and metrics.json go.
        precision: 32-true, bf16-mixed, bf16-true, 16-mixed or fp8-mixed (default: bf16-mixed on GPUs and on CPUs with
            native bf16, AVX512-BF16 or AMX; 32-true on other CPUs; printed at start).
        resume: Continue a run: "auto" (the newest checkpoint in out_dir), a step-XXXXXX folder, or false.
        data: The data module: pretraining text or instruction data (default: the bundled tiny corpus, `Tiny`).
        train: Training schedule and batch sizes.
        eval: Validation settings.
        optimizer: An optimizer name (AdamW) or a mapping {class_path, init_args} (lr, weight_decay, betas).
        devices: Devices per node (an int, or "auto").
        num_nodes: Nodes of the run.
        fsdp: How runs on several devices shard the student and the teacher (--fsdp.sharding_strategy, ...).
        parallel: Parallelism beside FSDP's: --parallel.tensor N splits each layer over N neighbouring devices
            (tensor and sequence parallelism; FSDP shards over the rest of the world); --parallel.expert N splits
            each mixture-of-experts layer's experts over N data-parallel devices (expert parallelism);
            --parallel.context N splits every sequence's positions over N devices (context parallelism, Ulysses'
            head scatter around each attention); --parallel.pipeline N cuts the layers into stages over N devices
            (pipeline parallelism, schedule --parallel.pipeline_schedule) (the teacher runs whole on
            every device, where the last stage's loss reads it).
        tokenizer_dir: The folder with tokenizer.json (default: student_dir, else teacher_dir).
        logger_name: The experiment tracker: csv, tensorboard, wandb (online unless WANDB_MODE says offline) or
            mlflow (to MLFLOW_TRACKING_URI, else out_dir/mlruns).
        logger: The tracker's run: --logger.project, --logger.name, --logger.entity, --logger.group,
            --logger.tags, as the tracker has them.
        seed: Seed of a random student's initialization and of the data order.
        profile: Record a torch.profiler trace of a few steps into out_dir/profile/.
        compiler: auto (as `litgpt pretrain`'s: torch on CUDA GPUs, and on CPUs for runs of at least 100 steps),
            none (eager), torch (torch.compile of each transformer block of the student and the teacher), or the
            name of a compiler extension registered under the `litgpt.compilers` entry points (thunder).
        strategy: How several devices train: auto or fsdp shard the models with FSDP (--fsdp.*); ddp replicates
            them (FSDP's NO_SHARD).
        kd: The distillation loss: --kd.loss forward_kl|reverse_kl|js, --kd.temperature, --kd.alpha.
    """
    job = distill_job(dict(locals()))
    fsdp = fsdp_for_strategy(strategy, fsdp)

    from litgpt.train.job import launch
    from litgpt.train.launch import run_fabric

    # whole_loss False: torch compiles the teacher's blocks too, as the student's.
    launch(run_fabric(job, devices=devices, num_nodes=num_nodes, fsdp=fsdp, parallel=parallel,
                      run_name=f"distill-{job.recipe.config.name or 'model'}", compiler=compiler, strategy=strategy,
                      whole_loss=False), job)


def distill_job(arguments: dict) -> "Job":
    """Pretraining's job of the student (from `student_dir`'s weights, or random) with the teacher in its recipe,
    every input checked before anything heavy is imported."""
    from litgpt.checkpoint.model_files import WEIGHTS_FILE
    from litgpt.pretrain import pretrain_job
    from litgpt.train.recipes.distill import DistillRecipe, TeacherSettings

    kd, student_dir = arguments["kd"], arguments["student_dir"]
    kd.check()
    teacher_dir = find_teacher_dir(arguments["teacher_dir"])
    random_student = arguments["model_name"] is not None or arguments["model_config"] is not None
    if student_dir is not None and random_student:
        raise UserError("Give the student as STUDENT_DIR or as --model_name / --model_config, not both.")
    if student_dir is None and not random_student:
        raise UserError("Give the student: a checkpoint folder (`litgpt distill STUDENT_DIR --teacher_dir "
                        "TEACHER_DIR`) or, for a random one, --model_name / --model_config.")
    # The student reads the teacher's tokenizer unless it has its own (the two must agree: check_same_vocabulary).
    tokenizer_dir = arguments["tokenizer_dir"] or (student_dir if student_dir is not None else teacher_dir)
    job = pretrain_job({**arguments, "initial_checkpoint_dir": student_dir, "tokenizer_dir": tokenizer_dir},
                       record_arguments_of=setup)
    teacher_config = Config.from_checkpoint(teacher_dir)
    check_teacher_fits(job.recipe.config, teacher_config, job.train, teacher_dir)
    check_same_vocabulary(job.tokenizer_dir, teacher_dir)
    teacher = TeacherSettings(config=teacher_config, weights=teacher_dir / WEIGHTS_FILE, kd=kd)
    # The student's weights come from its checkpoint whole: nothing to draw first.
    initialization = "random" if student_dir is None else "checkpoint"
    recipe = DistillRecipe(**{**vars(job.recipe), "name": "distill", "initialization": initialization},
                           teacher=teacher)
    return dataclasses.replace(job, recipe=recipe)


def find_teacher_dir(teacher_dir: Optional[Path]) -> Path:
    """The teacher's checkpoint folder, checked: weights and config."""
    from litgpt.checkpoint.model_files import find_checkpoint_dir

    if teacher_dir is None:
        raise UserError("Give the teacher's checkpoint folder with --teacher_dir.")
    try:
        return find_checkpoint_dir(Path(teacher_dir))
    except UserError as error:
        raise UserError(f"--teacher_dir: {error}") from None


def check_teacher_fits(student: Config, teacher: Config, train: TrainArgs, teacher_dir: Path) -> None:
    """UserError when the two models' logits do not line up token by token, or the samples outgrow the teacher."""
    for field in ("vocab_size", "padded_vocab_size"):
        ours, theirs = getattr(student, field), getattr(teacher, field)
        if ours != theirs:
            raise UserError(
                f"The student's {field} is {ours} but the teacher's ({teacher_dir}) is {theirs}: distillation "
                "compares their distributions token by token, so both need the same vocabulary."
            )
    length = train.max_seq_length or student.block_size
    if length > teacher.block_size:
        raise UserError(f"Samples of {length} tokens are longer than the teacher's block size {teacher.block_size}: "
                        f"give --train.max_seq_length {teacher.block_size} or less.")


def check_same_vocabulary(student_tokenizer_dir: Path, teacher_dir: Path) -> None:
    """UserError when the student's and the teacher's tokenizers (where both folders have one) map some token to
    different ids: the same vocabulary size is not enough for their distributions to be comparable."""
    from litgpt.tokenizer import Tokenizer

    folders = (Path(student_tokenizer_dir), Path(teacher_dir))
    if folders[0].resolve() == folders[1].resolve():
        return
    if not all(any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model")) for folder in folders):
        return
    ours, theirs = (Tokenizer(folder).backend.get_vocab(with_added_tokens=True) for folder in folders)
    differ = sorted(token for token in ours.keys() | theirs.keys() if ours.get(token) != theirs.get(token))
    if differ:
        raise UserError(
            f"The student's tokenizer ({student_tokenizer_dir}) and the teacher's ({teacher_dir}) differ: "
            f"{len(differ)} token(s) have another id or are missing in one (first: {differ[0]!r}); distillation "
            "compares their distributions token by token, so both need the same tokenizer."
        )
