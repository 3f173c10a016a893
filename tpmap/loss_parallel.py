"""loss_parallel: the cross-entropy of a vocabulary-parallel LM head computed on each rank's shard of the
logits (`engine.loss` holds the math), wired into a transformers model's own loss."""
from __future__ import annotations

import functools

import torch
from torch import nn

from tpmap.api_errors import LossParallelError
from tpmap.engine.layers import VocabParallelLMHead
from tpmap.engine.loss import hf_loss_function, sharded_cross_entropy


def use_loss_parallel(model: nn.Module, head: VocabParallelLMHead) -> None:
    """Keep `head`'s logits split along the vocabulary in training mode, and compute the model's loss on the
    shards (its `loss_function` replaced); a forward with labels that computes its loss otherwise raises."""
    head.loss_parallel = True
    replacement = hf_loss_function(model.loss_function, head)
    if replacement is not None:
        model.loss_function = replacement
    forward = model.forward
    message = (f"{type(model).__name__} computes its loss from labels without its loss_function, on vocabulary-"
               "sharded logits, so that loss would be wrong. With loss_parallel, call the model without labels and "
               "use tpmap.vocab_parallel_cross_entropy(model, outputs.logits, labels).")

    @functools.wraps(forward)  # keeps the signature transformers inspects (e.g. for logits_to_keep)
    def forward_with_loss_check(*args, **kwargs):
        # labels given but the loss not computed by our loss_function: refuse rather than return a wrong loss
        calls = head.loss_calls
        with_labels = kwargs.get("labels") is not None
        try:
            out = forward(*args, **kwargs)
        except Exception as e:
            if with_labels and head.loss_calls == calls:
                raise LossParallelError(message) from e
            raise
        if with_labels and head.loss_calls == calls:
            raise LossParallelError(message)
        return out

    model.forward = forward_with_loss_check


def vocab_parallel_cross_entropy(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of a vocabulary-parallel model's logits (no label shift), computed on this
    rank's vocabulary shard: local logits (loss_parallel in training mode) or gathered ones."""
    head = next((m for m in model.modules() if isinstance(m, VocabParallelLMHead)), None)
    if head is None:
        raise LossParallelError("the model has no vocabulary-sharded LM head (vocab_parallel.lm_head in its mapping)")
    return sharded_cross_entropy(logits, labels, head, ignore_index)
