"""Rank functions for tests/test_trainer.py: Hugging Face Trainer runs on a tiny Llama, tensor-parallel through
`tpmap.training.trainer.TensorParallelTrainer`, or unsharded through plain `transformers.Trainer` on a 1-rank pool
(the reference, computed in the same test run on the same data).

The model: the llama mapping's tiny config (12 query heads, 2 KV heads, vocabulary 256, 2 layers), every weight
redrawn with std 0.15, fp32, no dropout. The data: 24 training and 9 evaluation sequences of 12 random ids, fixed
(no padding: every sequence counts the same tokens). A run: 6 optimizer steps of a global batch of 8 sequences
(per-device batch 8 / dp / grad_accum) with gradient accumulation 2, Trainer's defaults otherwise (AdamW, linear
decay, max_grad_norm 1.0), logging every step; then an evaluation (per-device batch 1).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import tpmap
from tpmap import verify

GLOBAL_BATCH = 8
GRAD_ACCUM = 2
STEPS = 6


class Sequences(torch.utils.data.Dataset):
    """`n` fixed sequences of `length` ids in [3, vocab): a causal LM learns them (labels = input_ids)."""

    def __init__(self, n: int, length: int, vocab: int, seed: int):
        self.ids = torch.randint(3, vocab, (n, length), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama(std: float = 0.15) -> torch.nn.Module:
    """The same tiny Llama on every rank (seeded)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(verify.tiny_config("llama"))
    verify.large_init_(model, 0, std)
    return model


def datasets(vocab: int) -> tuple[Sequences, Sequences]:
    return Sequences(24, 12, vocab, seed=1), Sequences(9, 12, vocab, seed=2)


def training_args(output_dir: str, per_device: int, **overrides):
    from transformers import TrainingArguments

    settings = dict(output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=per_device,
                    per_device_eval_batch_size=1, gradient_accumulation_steps=GRAD_ACCUM, learning_rate=3e-3,
                    logging_steps=1, save_strategy="no", report_to="none", seed=0, use_cpu=True,
                    disable_tqdm=True, dataloader_num_workers=0)
    return TrainingArguments(**{**settings, **overrides})


def _history(trainer) -> dict:
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"losses": [h["loss"] for h in logs], "grad_norms": [h["grad_norm"] for h in logs],
            "steps": [h["step"] for h in logs]}


def reference_run(output_dir: str, overrides: dict) -> dict:
    """Plain transformers.Trainer on the unsharded model (a 1-rank pool: Trainer sees no distribution)."""
    from transformers import Trainer

    assert dist.get_world_size() == 1
    model = tiny_llama()
    train, evaluation = datasets(model.config.vocab_size)
    args = training_args(output_dir, GLOBAL_BATCH // GRAD_ACCUM, **overrides)
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation)
    trainer.train()
    out = {**_history(trainer), "eval_loss": trainer.evaluate()["eval_loss"]}
    trainer.save_model(os.path.join(output_dir, "final"))
    return out


def tp_run(output_dir: str, dp: int, overrides: dict, resume: bool = False, save_final: bool = True) -> dict:
    """TensorParallelTrainer on this pool: tp = world / dp; with dp > 1 a (dp, tp) mesh, DDP over "dp"."""
    from torch.distributed.device_mesh import init_device_mesh

    from tpmap.training.trainer import TensorParallelTrainer

    tp = dist.get_world_size() // dp
    dp_group = None
    model = tiny_llama()
    if dp > 1:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        model, dp_group = tpmap.apply(model, group=mesh["tp"]), mesh["dp"]
    else:
        model = tpmap.apply(model, tp)
    train, evaluation = datasets(model.config.vocab_size)
    args = training_args(output_dir, GLOBAL_BATCH // GRAD_ACCUM // dp, **overrides)
    trainer = TensorParallelTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                                    dp_group=dp_group)
    trainer.train(resume_from_checkpoint=resume or None)
    out = {**_history(trainer), "eval_loss": trainer.evaluate()["eval_loss"], "rank": dist.get_rank()}
    if save_final:
        trainer.save_model(os.path.join(output_dir, "final"))
    return out


def setup_errors(output_dir: str) -> dict:
    """What TensorParallelTrainer refuses, on 2 ranks at tp 2: its error type and message per case."""
    from tpmap.training.trainer import TensorParallelTrainer

    model = tpmap.apply(tiny_llama(), 2)
    train, evaluation = datasets(model.config.vocab_size)
    cases = {
        "average_tokens": (dict(average_tokens_across_devices=False), None),
        "best_model": (dict(load_best_model_at_end=True, eval_strategy="steps", save_strategy="steps"), None),
        "dp_group_size": ({}, dist.group.WORLD),  # tp 2 of 2 ranks: the dp group has 1 rank, not 2
    }
    out = {}
    for name, (overrides, dp_group) in cases.items():
        try:
            TensorParallelTrainer(model=model, args=training_args(output_dir, 4, **overrides), train_dataset=train,
                                  eval_dataset=evaluation, dp_group=dp_group)
        except tpmap.TpmapError as e:
            out[name] = (type(e).__name__, str(e))
    trainer = TensorParallelTrainer(model=model, args=training_args(output_dir, 4), train_dataset=train)
    os.makedirs(os.path.join(output_dir, "not-a-checkpoint"), exist_ok=True)
    try:
        trainer.train(resume_from_checkpoint=os.path.join(output_dir, "not-a-checkpoint"))
    except tpmap.TpmapError as e:
        out["resume"] = (type(e).__name__, str(e))
    return out


def trl_sft_refused(output_dir: str) -> tuple[str, str]:
    """TRL's SFTTrainer with the mixin on a tp 2 model: refused (its fused LM head reads lm_head.weight, a vocabulary
    shard here). Needs trl and datasets (optional)."""
    import datasets as hf_datasets
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    from tpmap.training.trainer import TensorParallelMixin

    class TensorParallelSFTTrainer(TensorParallelMixin, SFTTrainer):
        pass

    model = tpmap.apply(tiny_llama(), 2)
    vocab = model.config.vocab_size
    words = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1")
    train, _ = datasets(vocab)
    data = hf_datasets.Dataset.from_dict({"input_ids": [row.tolist() for row in train.ids]})
    args = SFTConfig(output_dir=output_dir, max_steps=1, report_to="none", use_cpu=True, disable_tqdm=True)
    try:
        TensorParallelSFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    except tpmap.TpmapError as e:
        return type(e).__name__, str(e)
    return "", ""
