"""The mapping schema: one YAML file per `config.model_type`, validated by these pydantic models.

A file lists TensorParallelismInfo entries of three kinds (a closed set):

* ``Column`` -- split the module's *output* features. ``Y = X A + b`` with ``A = [A_0 | ... | A_n-1]``
  split by columns: rank r computes ``Y_r = X A_r + b_r``. The input enters through
  ``copy_to_tp_region`` (identity forward, all-reduce backward).
* ``Row`` -- split the module's *input* features. ``Y = X A + b`` with ``A`` split by rows and ``X``
  already split by columns (the output of a Column): rank r computes ``X_r A_r``, the partial sums are
  all-reduced (``reduce_from_tp_region``) and ``b`` is added once, after the reduce.
* ``Update`` -- module attributes that hold full sizes (``num_heads``, ``split_size``) become per-rank
  values, given as expressions (see `tpmap.expr`).

Module patterns are dotted paths relative to the model's *base model* (``model.base_model`` in
transformers: ``transformer`` in GPT2LMHeadModel, ``model`` in LlamaForCausalLM, the model itself for
T5), with shell globs matched per dotted component: ``h.*.attn.c_attn`` matches ``h.0.attn.c_attn``
but not ``h.0.attn.inner.c_attn``.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from . import expr

ENTRY_KINDS = ("Column", "Row", "Update")


def _check_expr(value: Any) -> Any:
    expr.parse(value)  # raises ExpressionError (a ValueError): pydantic reports it at this field
    return value


def _check_pattern(value: str) -> str:
    parts = value.split(".")
    if not value or any(not p for p in parts):
        raise ValueError(f"module pattern {value!r} has an empty component; write dotted names like 'h.*.attn'")
    return value


def _check_attribute_path(key: str) -> str:
    if not key or any(not p.isidentifier() for p in key.split(".")):
        raise ValueError(f"attribute path {key!r} must be dotted Python identifiers")
    return key


Expr = Annotated[Union[StrictInt, str], Field(description="integer expression, see tpmap.expr")]
# checked where it stands, so that an error points at the very value (an Update attribute)
CheckedExpr = Annotated[Union[StrictInt, str], AfterValidator(_check_expr),
                        Field(description="integer expression, see tpmap.expr")]
AttributePath = Annotated[str, AfterValidator(_check_attribute_path)]
WorldSize = Annotated[StrictInt, Field(ge=1)]
Pattern = Annotated[str, Field(description="dotted module path relative to the base model; * globs per component")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Section(_Strict):
    """One block of a fused weight, in the order the blocks are stored along the split dimension."""

    size: Expr | None = Field(
        None, description="features in this section (expression); default: heads x the common head size"
    )
    heads: Expr | None = Field(
        None,
        description="attention heads in this section (expression). When given, the section is split on head "
        "boundaries; with fewer heads than ranks each head is replicated on tp_size/heads ranks (MQA/GQA K/V).",
    )

    _v_size = field_validator("size")(lambda v: v if v is None else _check_expr(v))
    _v_heads = field_validator("heads")(lambda v: v if v is None else _check_expr(v))

    @model_validator(mode="after")
    def _one_of(self):
        if self.size is None and self.heads is None:
            raise ValueError("a section needs 'size' or 'heads' (or both)")
        return self


class _Sharded(_Strict):
    module: Pattern = Field(description="modules to shard: nn.Linear, nn.Embedding, or a weight stored [in, out]")
    reverse: StrictBool = Field(
        False,
        description="the weight is stored [in, out] (transformers' Conv1D) instead of nn.Linear's [out, in]; "
        "the split dimensions of the weight are swapped accordingly (the bias is unaffected)",
    )
    combined_qkv: StrictBool = Field(
        False,
        description="the split dimension holds [q | k | v] one after the other (three sections). The engine "
        "gives every rank [q_r | k_r | v_r]. Sections are equal unless 'sections' states them (GQA). Not for "
        "head-major layouts ([heads, 3, head_dim], e.g. GPT-NeoX): those are a plain split.",
    )
    sections: StrictInt | list[Section] | None = Field(
        None,
        description="the split dimension is a concatenation of blocks, each split on its own and regrouped "
        "per rank: an integer N for N equal blocks ([gate | up] is 2), or a list of sections with sizes",
    )
    heads: Expr | None = Field(
        None,
        description="attention heads along the split dimension (per section when sections are equal); splits "
        "on head boundaries and checks the world size divides the heads",
    )

    _v_heads = field_validator("heads")(lambda v: v if v is None else _check_expr(v))
    _v_module = field_validator("module")(lambda v: _check_pattern(v))

    @model_validator(mode="after")
    def _fusion(self):
        n = self.sections if isinstance(self.sections, int) else len(self.sections or [])
        if self.sections is not None and n < 2:
            raise ValueError("'sections' needs at least 2 blocks; leave it out for an unfused weight")
        if self.combined_qkv and self.sections is not None and n != 3:
            raise ValueError(f"combined_qkv means 3 sections [q | k | v], but 'sections' gives {n}")
        if isinstance(self.sections, list) and self.heads is not None:
            raise ValueError("give 'heads' per section when the sections are listed, not on the entry")
        return self

    def section_specs(self) -> list[tuple[Any, Any]]:
        """The blocks along the split dimension as (size, heads) expressions, None where unstated.

        An unfused weight is one block. Blocks without a size share what the sized blocks leave, in
        proportion to their heads (1 each when no heads are given): equal [q | k | v] thirds, or GQA
        [q | k | v] from head counts alone.
        """
        if isinstance(self.sections, list):
            return [(s.size, s.heads) for s in self.sections]
        n = 3 if self.combined_qkv and self.sections is None else (self.sections or 1)
        return [(None, self.heads)] * n


class Column(_Sharded):
    """Split the output features: rank r holds rows [r] of an nn.Linear weight (columns of A in Y = XA)."""

    kind: Literal["Column"]
    gather_output: StrictBool = Field(
        False, description="all-gather the output back to the full width (in the original feature order)"
    )


class Row(_Sharded):
    """Split the input features; the partial outputs are all-reduced and the bias is added once."""

    kind: Literal["Row"]


class Update(_Strict):
    """Set module attributes to per-rank values.

    Keys are attribute paths on the matched module; a path through ``config`` (``config.num_attention_heads``)
    gives the module its own copy of the config, so the model's shared config keeps the full sizes.
    """

    kind: Literal["Update"]
    module: Pattern = Field(description="modules whose attributes change")
    attributes: dict[AttributePath, CheckedExpr] = Field(
        min_length=1, description="attribute path -> per-rank value (expression), e.g. num_heads: n_head // tp_size"
    )

    _v_module = field_validator("module")(lambda v: _check_pattern(v))


Entry = Annotated[Union[Column, Row, Update], Field(discriminator="kind")]


class Input(_Strict):
    """One example input of a verify config: a tensor of this shape, filled according to its kind."""

    shape: list[CheckedExpr] = Field(
        min_length=1, description="dimensions, integer expressions over config attributes and `batch` / `seq` "
        "(the batch size and sequence length of the derived inputs), e.g. [batch, num_mel_bins, 2 * max_source_positions]"
    )
    kind: Literal["ids", "float", "mask"] = Field(
        "ids", description="ids: random token ids in [3, vocab_size); float: standard normal values; mask: ones, "
        "with the last row's last 3 positions 0 (right padding)"
    )


class Verify(_Strict):
    """An embedded tiny configuration that `tpmap verify` and the tests build (no download)."""

    name: str = Field("default", description="a short name for this configuration in reports")
    config: dict[str, Any] = Field(
        description="overrides for AutoConfig.for_model(model_type); keep it tiny, with head counts that "
        "divide the world sizes you claim (12 heads cover 1, 2, 3, 4)"
    )
    models: list[str] = Field(min_length=1, description="transformers class names to build, e.g. LlamaForCausalLM")
    world_sizes: list[WorldSize] = Field([1, 2, 4], description="world sizes `tpmap verify` runs")
    inputs: dict[str, Input] = Field(
        {}, description="example inputs by forward argument name, added to (or replacing) those derived from the "
        "model class: input_ids + attention_mask when its main input is input_ids, decoder_input_ids for an "
        "encoder-decoder. A main input other than input_ids must be declared (Whisper's input_features)"
    )


class VocabParallel(_Strict):
    """Split the vocabulary of the input embedding and the LM head over the ranks (Megatron's
    VocabParallelEmbedding and parallel LM head). Both are found through transformers' own API
    (``get_input_embeddings()`` / ``get_output_embeddings()``), so no pattern is needed; every module
    that shares the embedding's weight (tied heads, per-stack copies) shares the one sharded weight.
    A vocabulary that the world size does not divide is padded; padded logits never reach outputs."""

    embedding: StrictBool = Field(
        True, description="rank r holds rows [r*V/ws, (r+1)*V/ws) of the input embedding: masked lookup + all-reduce"
    )
    lm_head: StrictBool = Field(
        True, description="rank r computes the logits of its vocabulary rows; they are all-gathered (full logits "
        "on every rank) unless tpmap.apply(..., loss_parallel=True) keeps them split for the loss"
    )


class Mapping(_Strict):
    """A whole mapping file."""

    model_type: str = Field(description="the transformers config.model_type this file maps")
    world_sizes: list[WorldSize] = Field(
        [1, 2, 4, 8], description="world sizes the mapping supports on the default config of the model type"
    )
    replicated: list[Pattern] = Field(
        [], description="modules kept whole on every rank on purpose (read by `tpmap lint` coverage)"
    )
    entries: list[Entry] = Field(min_length=1, description="the TensorParallelismInfo entries")
    vocab_parallel: VocabParallel | None = Field(
        None, description="split the embedding and LM head along the vocabulary (omit to keep them replicated)"
    )
    grad_allreduce: list[Pattern] = Field(
        [],
        description="modules kept whole whose parameters see only this rank's shard of the activations (e.g. a "
        "per-head q/k norm applied to local heads): their gradients are summed over the ranks in backward",
    )
    verify: list[Verify] = Field(
        min_length=1, description="tiny configurations to prove the mapping on (e.g. GQA, and MHA for world size 3)"
    )

    _v_replicated = field_validator("replicated", "grad_allreduce")(lambda v: [_check_pattern(p) for p in v])


def json_schema() -> dict:
    """The JSON Schema of a mapping file, generated from `Mapping` (what `tpmap schema` prints and
    ``mappings/mapping.schema.json``, beside the shipped YAML files that reference it, holds)."""
    schema = Mapping.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema, "title": "tpmap mapping file"}
