"""The repeated blocks of a model: the items of the base model's outermost nn.ModuleLists."""
from __future__ import annotations

from torch import nn


def block_prefixes(base: nn.Module) -> list[str]:
    """The repeated blocks: the elements of the outermost nn.ModuleLists of the base model
    (``h.0``, ``layers.3``, ``encoder.block.1``, ``encoder.layer.0``). A ModuleList inside a block
    (T5's ``block.0.layer``, experts) belongs to that block."""
    lists: list[str] = []
    for name, module in base.named_modules():
        if isinstance(module, nn.ModuleList) and name and not any(name.startswith(p + ".") for p in lists):
            lists.append(name)
    return [f"{ln}.{child}" for ln in lists for child, _ in base.get_submodule(ln).named_children()]


def block_of(name: str, blocks: list[str]) -> str | None:
    """The block `name` is (or lies in), or None."""
    for b in blocks:
        if name == b or name.startswith(b + "."):
            return b
    return None
