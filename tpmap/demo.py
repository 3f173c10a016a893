"""`tpmap demo`: the main job on an embedded default, for a first run on any machine.

A small Llama (the shipped mapping's first verify config, fixed weights: seed 0, a wide init so that greedy decoding
does not repeat one token) and a character-level tokenizer are saved to a temporary folder; `tpmap.parallelize`
starts 2 CPU workers (gloo ranks, no torchrun), each loading only its own slices; greedy generate runs sharded, then
the unsharded model generates from the same folder in this process, and the two token lists are compared. With
``--model DIR`` the same for a checkpoint folder (its tokenizer when the folder has one). No download either way.

    tpmap demo                                   # about a minute on 2 cores
    tpmap demo --model DIR -n 2 --prompt "Hello"
    tpmap demo --save tiny-llama                 # keeps the tiny checkpoint (the README's snippets load it)

Exit status 0 when the tokens are equal, 1 when they differ.
"""
from __future__ import annotations

import string
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from tpmap.parallelize.handle import parallelize
from tpmap.verify import build_model

PROMPT = "Tensor parallelism, exactly:"


def tiny_checkpoint(folder: str) -> None:
    """A tiny random Llama with fixed weights and a character-level tokenizer, saved to `folder`."""
    model = build_model("llama", 0, "LlamaForCausalLM")
    vocab = {"<pad>": 0, "<unk>": 1, "<s>": 2, "</s>": 3}
    for char in string.printable:
        vocab.setdefault(char, len(vocab))
    chars = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    chars.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    chars.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=chars, pad_token="<pad>", unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>")
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def prompt_ids(folder: str, text: str):
    """(token ids [1, T] of `text`, the tokenizer or None): through the folder's tokenizer (and its chat template)
    when it has one, else the bytes of the text modulo the vocabulary."""
    if any((Path(folder) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)["input_ids"]
        else:
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
        return ids, tokenizer
    vocab = AutoConfig.from_pretrained(folder).get_text_config().vocab_size
    return torch.tensor([[b % vocab for b in text.encode()]]), None


def run(model: str | None = None, world_size: int = 2, prompt: str = PROMPT, new_tokens: int = 24, out=None,
        save: str | None = None) -> int:
    """Generate sharded and unsharded, print both (to `out`, default stdout), and return 0 when the tokens are
    equal (1 otherwise). `save`: keep the tiny checkpoint in this folder (the README's snippets load it)."""
    out = out or sys.stdout
    start = time.perf_counter()
    transformers.utils.logging.disable_progress_bar()  # the saving and loading bars of a tiny model are noise here
    with tempfile.TemporaryDirectory() as tmp:
        folder = model or save or tmp
        if model is None:
            tiny_checkpoint(folder)
            print(f"a tiny Llama (mappings/llama.yaml's first verify config, fixed weights) saved to {folder}",
                  file=out)
        ids, tokenizer = prompt_ids(folder, prompt)
        settings = dict(max_new_tokens=new_tokens, do_sample=False)
        with parallelize(folder, world_size, device="cpu") as sharded:
            s = sharded.startup
            print(f"{world_size} CPU workers ready in {s.total_s:.1f} s (each loaded only its own slices)", file=out)
            pad = sharded.generation_config.pad_token_id
            settings["pad_token_id"] = pad if pad is not None else getattr(tokenizer, "pad_token_id", None)
            got = sharded.generate(ids, **settings)
        full = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            want = full.generate(ids, **settings)
    new_got, new_want = got[0, ids.shape[1]:].tolist(), want[0, ids.shape[1]:].tolist()
    def show(label: str, tokens: list[int]) -> None:
        text = f" = {tokenizer.decode(tokens)!r}" if tokenizer is not None else ""
        print(f"{label:<16}{tokens}{text}", file=out)
    print(f"{'prompt':<16}{prompt!r}", file=out)
    show(f"sharded over {world_size}", new_got)
    show("unsharded", new_want)
    equal = got.shape == want.shape and torch.equal(got, want)
    print(f"equal: {'yes' if equal else 'NO'} ({time.perf_counter() - start:.0f} s)", file=out)
    return 0 if equal else 1
