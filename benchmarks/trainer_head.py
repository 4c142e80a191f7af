"""The trainer's log-prob forward and backward with the LM head at every position of a packed row
against the head at its completion positions only (``trainer.model.token_logprobs``, which passes
the loss positions as transformers' ``logits_to_keep``).

    python benchmarks/trainer_head.py --layers 1 --prompt 256 --completion 256 --repeat 3

The model is the ``qwen2.5-0.5b`` profile (vocabulary 151,936, hidden 896, tied embeddings;
``node/devnet/profile.py``) at ``--layers`` decoder layers with fresh float32 weights; the row is
``--rows`` sequences of ``--prompt`` prompt and ``--completion`` completion tokens, packed as the
trainer packs them. Prints, per path, the median CPU seconds of one forward + backward (of
``--repeat``, process time), the float32 logits' bytes, and the ratios. Both paths give the same log-probs at the
completion positions (checked: the largest difference is printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from node.devnet.profile import PROFILES
from protocol.models import build_model
from trainer.batch import MicroBatch
from trainer.model import token_logprobs


def full_head_logprobs(model: torch.nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The former path: logits at every position ``[1, T, V]``, then each target's log-prob and the entropy, ``[1, T]`` each."""
    logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits.float()  # [1, T, V]
    logz = torch.logsumexp(logits, dim=-1)
    entropy = logz - (F.softmax(logits, dim=-1) * logits).sum(-1)
    return torch.gather(logits, -1, mb.targets.unsqueeze(-1)).squeeze(-1) - logz, entropy


def packed_row(vocab: int, rows: int, prompt: int, completion: int, seed: int) -> MicroBatch:
    """``rows`` sequences of ``prompt + completion`` random ids in one row, loss on the completion targets."""
    g = torch.Generator().manual_seed(seed)
    n = prompt + completion
    ids = torch.randint(2, vocab, (rows, n), generator=g)
    targets = torch.cat([ids[:, 1:], torch.zeros(rows, 1, dtype=torch.long)], dim=1)
    mask = torch.zeros(rows, n, dtype=torch.bool)
    mask[:, prompt - 1: n - 1] = True  # position t predicts token t + 1: the completion's tokens
    flat = lambda x: x.reshape(1, -1)
    return MicroBatch(input_ids=flat(ids), position_ids=flat(torch.arange(n).repeat(rows, 1)), targets=flat(targets),
                      loss_mask=flat(mask), advantages=flat(torch.ones(rows, n)),
                      sequence_index=flat(torch.arange(rows)[:, None].expand(rows, n)), behavior_logprobs=flat(torch.zeros(rows, n)))


def timed(step: Callable[[], None], repeat: int) -> float:
    """Median CPU seconds of ``step`` over ``repeat`` runs, after one warm-up (CPU time, not wall: the
    figure holds on a machine shared with other work)."""
    step()  # warm-up
    times = []
    for _ in range(repeat):
        t = time.process_time()
        step()
        times.append(time.process_time() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=1, help="decoder layers of the profile model (the profile has 24)")
    ap.add_argument("--rows", type=int, default=2, help="sequences packed in the row")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per sequence")
    ap.add_argument("--completion", type=int, default=256, help="completion tokens per sequence")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    profile = PROFILES["qwen2.5-0.5b"]
    model = build_model(profile.config(args.layers), seed=0).train()
    mb = packed_row(profile.vocab_size, args.rows, args.prompt, args.completion, seed=1)
    mask = mb.loss_mask[0]

    def old() -> None:
        model.zero_grad(set_to_none=True)
        lp, _ = full_head_logprobs(model, mb)  # as the trainer's step: the entropy computed, its metric detached
        lp[0][mask].sum().backward()

    def new() -> None:
        model.zero_grad(set_to_none=True)
        lp, _ = token_logprobs(model, mb, with_entropy=True)
        lp[0][mask].sum().backward()

    with torch.no_grad():
        diff = float((full_head_logprobs(model, mb)[0][0][mask] - token_logprobs(model, mb)[0][0][mask]).abs().max())
    t_old, t_new = timed(old, args.repeat), timed(new, args.repeat)
    T, K, V = mb.num_tokens, mb.num_loss_tokens, profile.vocab_size
    print(f"profile qwen2.5-0.5b at {args.layers} layer(s): row of {T} tokens ({args.rows} × {args.prompt} prompt + "
          f"{args.completion} completion), {K} loss positions, {args.threads} thread(s); largest log-prob difference {diff:.2e}")
    print(f"{'path':<28}{'fwd+bwd CPU s':>15}{'logits bytes':>16}")
    print(f"{'head at every position':<28}{t_old:>15.3f}{T * V * 4:>16,}")
    print(f"{'head at completion only':<28}{t_new:>15.3f}{K * V * 4:>16,}")
    print(f"trainer head: {t_old / t_new:.2f}x faster, logits {T / K:.2f}x smaller")


if __name__ == "__main__":
    main()
