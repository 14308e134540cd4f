"""`litgpt evaluate --batch_size auto`: the largest batch of full-length sequences the device holds.

On a GPU it is found by trying: a forward pass of `MAX_AUTO_BATCH_SIZE` rows of `max_length` tokens with the logits of
every position (the most a loglikelihood batch can ask), halving on out-of-memory, as lm-eval's transformers model
does. On a CPU, where running out of memory kills the process instead of raising, it is estimated from the memory free
now and the activations of one row. The number is the same for every rank (the smallest one's).
"""

from __future__ import annotations

import sys

import torch

from litgpt.errors import UserError

MAX_AUTO_BATCH_SIZE = 64  # lm-eval's default max_batch_size: larger batches gain little
CPU_MEMORY_SHARE = 0.25  # of the free memory, for the activations (the rest: the OS, the data, other processes)


def parse_batch_size(batch_size) -> int | str:
    """--batch_size as a number >= 1 or "auto"."""
    if isinstance(batch_size, str) and batch_size.strip().lower() == "auto":
        return "auto"
    try:
        number = int(batch_size)
    except (TypeError, ValueError):
        raise UserError(f"--batch_size must be a number >= 1 or 'auto', got {batch_size!r}.") from None
    if number < 1 or isinstance(batch_size, float) and batch_size != number:
        raise UserError(f"--batch_size must be a number >= 1 or 'auto', got {batch_size!r}.")
    return number


def auto_batch_size(model, max_length: int) -> int:
    """The largest batch of `max_length`-token sequences `model` can score at once on its device."""
    device = model.lm_head.weight.device
    chosen = probe_gpu(model, max_length) if device.type == "cuda" else estimate_from_memory(model, max_length)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        smallest = torch.tensor(chosen, device=device)
        torch.distributed.all_reduce(smallest, op=torch.distributed.ReduceOp.MIN)
        chosen = int(smallest.item())
    print(f"--batch_size auto: {chosen} (sequences of up to {max_length} tokens).", file=sys.stderr)
    return chosen


@torch.inference_mode()
def probe_gpu(model, max_length: int) -> int:
    from litgpt.evaluation.harness import output_logits

    device = model.lm_head.weight.device
    batch_size = MAX_AUTO_BATCH_SIZE
    while batch_size >= 1:
        try:
            hidden = model(torch.ones(batch_size, max_length, dtype=torch.long, device=device), return_hidden=True)
            output_logits(model, hidden).float().log_softmax(dim=-1)
            return batch_size
        except torch.cuda.OutOfMemoryError:
            batch_size //= 2
        finally:
            hidden = None  # noqa: F841 (the activations go before the next try, or before the evaluation)
            torch.cuda.empty_cache()
    raise UserError(f"Not even one sequence of {max_length} tokens fits in the GPU's memory beside the model: lower "
                    "--max_length, or use --precision bf16-true or a larger GPU.")


def estimate_from_memory(model, max_length: int) -> int:
    """Rows whose activations fit in CPU_MEMORY_SHARE of the free memory: per row and token the residual stream and
    its norms and attention outputs, the MLP's intermediate activations, a float32 logits row and its log-softmax;
    per row and head the attention scores (max_length squared)."""
    import psutil

    config = model.config
    item = model.lm_head.weight.element_size()
    per_token = (8 * config.n_embd + 3 * config.intermediate_size) * item + 2 * config.padded_vocab_size * 4
    per_row = max_length * per_token + config.n_head * max_length * max_length * 4
    fitting = int(psutil.virtual_memory().available * CPU_MEMORY_SHARE) // per_row
    return max(1, min(MAX_AUTO_BATCH_SIZE, fitting))
