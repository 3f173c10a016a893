"""Cross-entropy on vocabulary-sharded logits, without gathering them (Megatron's vocab-parallel CE).

Each rank holds logits Z_r (N, V_pad/tp_size) for vocabulary rows [start, end). With m = max_v Z (an
all-reduce MAX) and S = sum_v exp(Z - m) (an all-reduce SUM of local sums), and z_y the target's
logit (held by one rank; an all-reduce SUM of masked values):

    loss_i = log S_i + m_i - z_{i,y_i}           dloss_i/dZ_r = softmax(Z)_r - onehot(y_i)_r

Padded columns (past the real vocabulary) are set to -inf, so they never count.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_end, group):
        # logits (N, V_local); target (N,) with ignored positions already replaced by any id
        ctx.dtype = logits.dtype
        local_real = vocab_end - vocab_start
        logits = logits.float().clone()
        if local_real < logits.shape[-1]:
            logits[:, local_real:] = float("-inf")
        m = logits.max(dim=-1).values  # (N,)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        logits.sub_(m.unsqueeze(-1))
        exp = logits.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        outside = (target < vocab_start) | (target >= vocab_end)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(target_logit, group=group)
        loss = sum_exp.log() - target_logit  # (N,)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= (~outside).to(grad.dtype)
        return (grad * grad_loss.unsqueeze(-1)).to(ctx.dtype), None, None, None, None


def sharded_cross_entropy(logits: torch.Tensor, target: torch.Tensor, head, ignore_index: int = -100,
                                 num_items_in_batch=None) -> torch.Tensor:
    """Mean (or sum / num_items_in_batch) cross-entropy against target (...) of a `VocabParallelLMHead`'s
    logits: its local shard (..., V_pad/tp_size), or gathered logits (..., V), of which this rank's part is used."""
    logits = head.local_logits(logits)
    logits = logits.reshape(-1, logits.shape[-1])
    target = target.reshape(-1).to(logits.device)
    keep = target != ignore_index
    per_token = _VocabParallelCE.apply(logits, target.masked_fill(~keep, 0), head.vocab_start, head.vocab_end,
                                       head.tp_group)
    total = (per_token * keep).sum()
    if num_items_in_batch is not None:
        return total / num_items_in_batch
    return total / keep.sum().clamp(min=1)


def hf_loss_function(original, head):
    """A replacement for a transformers model's `loss_function` that keeps the causal-LM label shift
    (ForCausalLMLoss) or not (ForMaskedLMLoss), computed on the head's vocabulary shard."""
    from transformers.loss.loss_utils import ForCausalLMLoss, ForMaskedLMLoss

    if original not in (ForCausalLMLoss, ForMaskedLMLoss):
        return None
    shift = original is ForCausalLMLoss

    def loss_function(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                      shift_labels=None, **kwargs):
        head.loss_calls += 1
        if shift:
            labels = shift_labels if shift_labels is not None else (
                torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:])
        return sharded_cross_entropy(logits, labels, head, ignore_index, num_items_in_batch)

    return loss_function
