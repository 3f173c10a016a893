"""LoRA through PEFT on a tensor-parallel model (`pip install 'tpmap[peft]'`; docs/lora.md).

* `adapters` -- the API: `get_peft_model`, `prepare`, `register`, `save_pretrained`, `from_pretrained`
* `layers`   -- the parallel LoRA layers (`ParallelLoraLinear`, `ParallelLoraEmbedding`, ...) and their math
"""
from tpmap.peft.adapters import (
    from_pretrained,
    get_peft_model,
    prepare,
    register,
    save_pretrained,
    take_over_entry_hooks,
)

__all__ = ["from_pretrained", "get_peft_model", "prepare", "register", "save_pretrained", "take_over_entry_hooks"]
