"""Multi-process runs under a real Slurm: a one-node cluster on localhost, set up by scripts/slurm-localhost.sh.

The fixture starts the cluster itself (installing Slurm with apt-get on first use, which needs root on Debian), so
these tests also run outside CI. The daemons are left running afterwards; `scripts/slurm-localhost.sh stop` ends them.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ports import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

# One rank of a gloo job: checks Lightning's view of Slurm against Slurm's own variables, all-reduces rank + 1 and
# prints one JSON line. barrier() + destroy_process_group() before exit: without them a rank can abort at teardown.
PROGRAM = """
import json, os
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment

detected = SLURMEnvironment.detect()
env = SLURMEnvironment()
rank, world_size = env.global_rank(), env.world_size()
dist.init_process_group("gloo", init_method=f"tcp://{env.main_address}:{env.main_port}", rank=rank, world_size=world_size)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
dist.barrier()
dist.destroy_process_group()
print("RESULT " + json.dumps({
    "detected": detected, "rank": rank, "world_size": world_size, "local_rank": env.local_rank(),
    "procid": int(os.environ["SLURM_PROCID"]), "ntasks": int(os.environ["SLURM_NTASKS"]),
    "localid": int(os.environ["SLURM_LOCALID"]), "sum": t.item(),
}), flush=True)
"""



def slurm_env(**extra: str) -> dict:
    """The current environment without SLURM_* (so that a pytest run inside a Slurm job starts its own job here)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**env, **extra}


def srun(args: list, env: dict = None, timeout: float = 120, cwd=None) -> subprocess.CompletedProcess:
    """`srun --kill-on-bad-exit=1 *args`, capturing text output; a hang fails with TimeoutExpired instead of blocking.

    --kill-on-bad-exit: when one rank dies, the others are killed rather than waiting for it in a collective.
    Note that Lightning ignores Slurm when the job name is "bash" or "interactive" (e.g. `srun bash -c ...`), and that
    its SLURMEnvironment raises for `--ntasks N > 1` without `--ntasks-per-node` (SLURM_NTASKS_PER_NODE is unset).
    """
    cmd = ["srun", "--kill-on-bad-exit=1", *map(str, args)]
    return subprocess.run(cmd, env=slurm_env() if env is None else env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def results(stdout: str) -> list:
    return sorted((json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")),
                  key=lambda r: r["rank"])


def expected(n: int) -> list:
    return [{"detected": True, "rank": r, "world_size": n, "local_rank": r, "procid": r, "ntasks": n, "localid": r,
             "sum": n * (n + 1) / 2} for r in range(n)]


def test_srun_all_reduce(slurm_cluster):
    """4 ranks on a 2-core machine (the script declares spare CPUs); 2 ranks: test_sbatch_wait's srun."""
    env = slurm_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    p = srun(["--ntasks-per-node", 4, sys.executable, "-c", PROGRAM], env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert results(p.stdout) == expected(4), p.stdout + p.stderr


def test_sbatch_wait(slurm_cluster, tmp_path):
    (tmp_path / "rank.py").write_text(PROGRAM)
    out = tmp_path / "result.txt"
    job = tmp_path / "job.sh"
    job.write_text(
        "#!/bin/bash\n"
        "#SBATCH --ntasks-per-node=2\n"
        f"#SBATCH --output={tmp_path}/slurm-%j.log\n"
        f"srun --kill-on-bad-exit=1 {sys.executable} {tmp_path / 'rank.py'} > {out}\n"
    )
    env = slurm_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    p = subprocess.run(["sbatch", "--wait", str(job)], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    logs = "".join(f.read_text() for f in tmp_path.glob("slurm-*.log"))
    assert p.returncode == 0, p.stdout + p.stderr + logs
    assert results(out.read_text()) == expected(2), out.read_text() + logs


# ---- litgpt under srun -------------------------------------------------------------------------------------------------
TINY_RUN = [
    "pretrain", "--config", ROOT / "config_hub" / "pretrain" / "tiny.yaml", "--train.max_steps", "2",
    "--train.global_batch_size", "4", "--train.micro_batch_size", "1", "--train.max_seq_length", "64",
    "--train.log_interval", "1", "--eval.max_iters", "1", "--eval.max_new_tokens", "0", "--eval.initial_validation",
    "false",
]
LITGPT = Path(sys.executable).parent / "litgpt"  # the console script `pip install` puts beside the interpreter


def test_srun_ntasks_litgpt_pretrain(slurm_cluster, tmp_path):
    # `srun --ntasks 2` (no --ntasks-per-node): Lightning alone refuses it; litgpt fills in the per-node count.
    env = slurm_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    out = tmp_path / "out"
    p = srun(["--ntasks", 2, LITGPT, *TINY_RUN, "--out_dir", out, "--data.cache_dir", tmp_path / "cache",
              "--devices", 2], env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["cluster_environment"] == "SLURMEnvironment" and metrics["world_size"] == 2
    assert metrics["sharding_strategy"] == "FULL_SHARD" and (out / "final" / "lit_model.pth").is_file()


def test_srun_task_count_that_does_not_match_the_flags(slurm_cluster, tmp_path):
    env = slurm_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    p = srun(["--ntasks", 2, LITGPT, *TINY_RUN, "--out_dir", tmp_path / "out", "--devices", 1], env=env)
    assert p.returncode != 0
    assert p.stderr.count("Slurm started 2 task(s) (2 per node), but --devices 1 --num_nodes 1") == 1, p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "out").exists()

