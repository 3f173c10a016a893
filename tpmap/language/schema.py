"""The mapping schema: one YAML file per `config.model_type`, validated by these pydantic models.

A file lists TensorParallelismInfo entries of eight kinds (a closed set). Three split modules
whose weights are matrices and one rewrites attributes:

* ``Column`` -- split the module's *output* features. ``Y = X A + b`` with ``A = [A_0 | ... | A_n-1]``
  split by columns: rank r computes ``Y_r = X A_r + b_r``. The input enters through
  ``copy_to_tp_region`` (identity forward, all-reduce backward).
* ``Row`` -- split the module's *input* features. ``Y = X A + b`` with ``A`` split by rows and ``X``
  already split by columns (the output of a Column): rank r computes ``X_r A_r``, the partial sums are
  all-reduced (``reduce_from_tp_region``) and ``b`` is added once, after the reduce.
* ``Update`` -- module attributes that hold full sizes (``num_heads``, ``split_size``) become per-rank
  values, given as expressions (see `tpmap.language.expr`).

Five more reach what matrices alone cannot (MoE experts, MLA, ALiBi, norms across shards, SSM mixers):

* ``Param`` -- split bare parameters, buffers or a ModuleList of a module along any dim (3-D expert
  weights ``[E, 2I, H]``, ``sinks [H]``, Mamba's ``A_log``, a depthwise conv's ``[C, 1, K]``); no
  collective of its own. ``partial: true`` instead keeps a term of a partial sum (a bias added inside
  the experts' sum) on rank 0 and zeros elsewhere, so the later all-reduce adds it once.
* ``Reduce`` -- a whole module whose parameters are split by ``Param`` computes a partial sum:
  ``Y = sum_r f_r(X)``. Its floating inputs enter through ``copy_to_tp_region`` and its output leaves
  through ``reduce_from_tp_region`` (the experts block of an MoE: one all-reduce for all experts).
* ``Enter`` -- a replicated module's output enters the TP region (``copy_to_tp_region``): for outputs
  that this rank's heads consume directly (DeepSeek MLA's shared rope key).
* ``Input`` -- slice a tensor argument of a module's forward by heads, for tensors the parent builds
  with the global head count (ALiBi ``[B*H, 1, S]``, ``[B, H, S, S]``): rank r keeps its heads.
* ``Norm`` -- an RMSNorm/LayerNorm over features that are split (OLMo2's q/k norm over all heads):
  the statistics are all-reduced (forward and backward), the weight is split with its features.

Every entry may carry ``when: {config_attribute: value}``: it applies only to configs that match, so
one file covers a family's config variants; ``when_layer: {per_layer_list: value}``: it applies only to the
matched modules of the layers whose entry of that config list matches (sliding vs full attention layers
of one class); and ``transformers: <range>``: it applies only on those releases of transformers, for a
module that a release renamed. An attribute that a config lacks reads as the mapping's
``config_defaults`` value for it (the default the model's own ``getattr(config, key, default)`` uses), else
as ``null``.

Module patterns are dotted paths relative to the model's *base model* (``model.base_model`` in
transformers: ``transformer`` in GPT2LMHeadModel, ``model`` in LlamaForCausalLM, the model itself for
T5), with shell globs matched per dotted component: ``h.*.attn.c_attn`` matches ``h.0.attn.c_attn``
but not ``h.0.attn.inner.c_attn``.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from tpmap.language import expr
from tpmap.language.errors import ConfigAttributeError

ENTRY_KINDS = ("Column", "Row", "Update", "Param", "Reduce", "Enter", "Input", "Norm", "Route")


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


Expr = Annotated[StrictInt | str, Field(description="integer expression, see tpmap.language.expr")]
# checked where it stands, so that an error points at the very value (an Update attribute)
CheckedExpr = Annotated[StrictInt | str, AfterValidator(_check_expr),
                        Field(description="integer expression, see tpmap.language.expr")]
AttributePath = Annotated[str, AfterValidator(_check_attribute_path)]


def _check_input_expr(value: Any) -> Any:
    if expr.layer_lists(value):  # parses it too
        raise expr.ExpressionError(f"expression {value!r}: at_layer(...) reads the layer of the module an entry is "
                                   "applied to, and a verify input belongs to no module (name a config attribute)")
    return value


# an expression outside every entry (a verify config's inputs): no module, so no at_layer(...)
InputExpr = Annotated[StrictInt | str, AfterValidator(_check_input_expr),
                      Field(description="integer expression, see tpmap.language.expr")]
WorldSize = Annotated[StrictInt, Field(ge=1, le=65536)]
Pattern = Annotated[str, Field(description="dotted module path relative to the base model; * globs per component")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_WHEN_OPS = {
    "not": lambda have, v: have != v,
    "gt": lambda have, v: _ordered(have, v) and have > v,
    "ge": lambda have, v: _ordered(have, v) and have >= v,
    "lt": lambda have, v: _ordered(have, v) and have < v,
    "le": lambda have, v: _ordered(have, v) and have <= v,
}


def _ordered(have, want) -> bool:
    return isinstance(have, (int, float)) and not isinstance(have, bool) and isinstance(want, (int, float))


def _check_when(when: dict[str, Any]) -> dict[str, Any]:
    for key, want in when.items():
        if isinstance(want, dict) and (len(want) != 1 or next(iter(want)) not in _WHEN_OPS):
            raise ValueError(f"when.{key}: a condition mapping has one operator key, one of "
                             f"{', '.join(_WHEN_OPS)} (e.g. {{gt: 1}}, {{not: null}}); got {sorted(want)}")
    return when


When = Annotated[
    dict[str, Any],
    AfterValidator(_check_when),
    Field(description="apply only when every config attribute named here matches: a value (equal), a list "
                      "(any of its values), or one operator {not: v}, {gt: v}, {ge: v}, {lt: v}, {le: v}; "
                      "e.g. when: {use_qk_norm: true}, when: {q_lora_rank: {not: null}}"),
]


def config_value(config, key: str, defaults: dict[str, Any] | None = None):
    """What a `when` condition reads for `key`: the config's attribute; where the config lacks it, the
    mapping's declared default (`Mapping.config_defaults`, what the model's own
    ``getattr(config, key, default)`` reads); else ``None``, so an absent attribute matches ``null``."""
    missing = object()
    have = getattr(config, key, missing)
    if have is missing:
        return (defaults or {}).get(key)
    return have


def _check_release_range(v: str | None) -> str | None:
    if v is not None:
        try:
            SpecifierSet(v)
        except InvalidSpecifier:
            raise ValueError(f"{v!r} is not a version range; write one such as '>=5.24' or '<5.24'") from None
    return v


ReleaseRange = Annotated[str | None, AfterValidator(_check_release_range)]


def release_matches(spec: str | None, version: str | None = None) -> bool:
    """Whether a `transformers` range (None: any release) admits `version` (default: the installed one)."""
    if spec is None:
        return True
    if version is None:
        import transformers  # the library the mapping describes; imported only when a range is given
        version = transformers.__version__
    return Version(version) in SpecifierSet(spec)


def entry_applies(entry, config, defaults: dict[str, Any] | None = None, version: str | None = None,
                  experts: str | None = None) -> bool:
    """Whether `entry` applies: its `when` matches `config`, its `transformers` range admits the release, and its
    `experts` placement (if any) is the chosen one, `experts`."""
    return (config_matches(entry.when, config, defaults) and release_matches(entry.transformers, version)
            and (entry.experts is None or entry.experts == experts))


def config_matches(when: dict[str, Any] | None, config, defaults: dict[str, Any] | None = None) -> bool:
    """True when `config` has every attribute of `when` at a required value (see `When`). An attribute the
    config lacks reads as its `defaults` value, or as None (see `config_value`)."""
    if not when:
        return True
    return all(_value_matches(want, config_value(config, key, defaults)) for key, want in when.items())


def _value_matches(want, have) -> bool:
    if isinstance(want, dict):
        (op, value), = want.items()
        return _WHEN_OPS[op](have, value)
    return have in want if isinstance(want, list) else have == want


def layer_index(name: str) -> int | None:
    """A module's layer: the first dotted component of its name that is an integer (``layers.3.self_attn`` -> 3,
    ``language_model.layers.5.mlp`` -> 5, ``encoder.block.2.layer.0.SelfAttention`` -> 2); None outside a stack."""
    return next((int(p) for p in name.split(".") if p.isdecimal()), None)


def layer_selected(when_layer: dict[str, Any], name: str, config, defaults: dict[str, Any] | None = None) -> bool:
    """True when the module `name` sits in a layer whose entries of the config's per-layer lists match
    `when_layer` ({layer_types: sliding_attention}: config.layer_types[i] == "sliding_attention" for layer i),
    with `when`'s value semantics. Raises ConfigAttributeError where that cannot be read."""
    i = layer_index(name)
    if i is None:
        raise ConfigAttributeError(f"{name} is in no stack of layers (no integer component in its name), so "
                                   "`when_layer` cannot read its layer's entry; use `when` or `classes` instead")
    lists = _per_layer_lists(when_layer, config, defaults)
    for key, values in lists.items():
        if i >= len(values):
            raise ConfigAttributeError(f"when_layer.{key}: {name} is layer {i}, but the config's {key} lists "
                                       f"{len(values)} layers")
    return all(_value_matches(want, lists[key][i]) for key, want in when_layer.items())


def any_layer_selected(when_layer: dict[str, Any], config, defaults: dict[str, Any] | None = None) -> bool:
    """Whether any layer of the config is of the kind `when_layer` names. None is: the entry does not apply to
    this config, as an entry whose `when` is false (a Nemotron-H stack without MLP layers has no MLP to split)."""
    lists = _per_layer_lists(when_layer, config, defaults)
    depth = min(len(values) for values in lists.values())
    return any(all(_value_matches(want, lists[key][i]) for key, want in when_layer.items()) for i in range(depth))


def _per_layer_lists(when_layer: dict[str, Any], config, defaults) -> dict[str, list]:
    lists = {}
    for key in when_layer:
        values = config_value(config, key, defaults)
        if not isinstance(values, (list, tuple)):
            raise ConfigAttributeError(f"when_layer.{key}: the config's {key} is {values!r}, not a list with one "
                                       f"entry per layer; valid keys are per-layer lists such as layer_types")
        lists[key] = list(values)
    return lists


Placement = Literal["split", "parallel"]


class _Entry(_Strict):
    module: Pattern = Field(description="dotted module path relative to the base model; * globs per component")
    when: When | None = None
    experts: Placement | None = Field(
        None, description="apply only under this placement of the MoE experts: split (each expert split along its "
        "intermediate width, tensor parallelism inside every expert) or parallel (whole experts dealt to the ranks, "
        "a Route entry). Chosen per call (tpmap.apply(experts=...)), by default the mapping's `experts`"
    )
    when_layer: When | None = Field(
        None, description="apply only to the matched modules whose layer i has config.<key>[i] matching (a value, a "
        "list, an operator, as `when`): e.g. when_layer: {layer_types: sliding_attention} selects the sliding "
        "layers' modules, whose head counts or parameters differ from the full layers' of the same class"
    )
    transformers: ReleaseRange = Field(
        None, description="the transformers releases this entry applies to, a PEP 440 range ('>=5.24', '<5.24'): "
        "for a module that a release renamed or restructured, one entry per layout, each with its range. On "
        "other releases the entry is skipped; lint reports a range that admits none of the releases tpmap proves"
    )
    classes: list[str] | None = Field(
        None, min_length=1,
        description="only the matched modules of these classes (class names): for hybrid stacks whose layer kinds "
        "share a module name, e.g. MiniMax's self_attn is a lightning or a softmax attention by layer",
    )

    _v_module = field_validator("module")(lambda v: _check_pattern(v))


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
    query_heads: Expr | None = Field(
        None, description="key/value heads: the query heads (expression) that share these heads, query head j "
        "reading head j // (query_heads / heads) (GQA). Needed at a world size that splits the query heads "
        "unevenly: each rank then holds every key/value head its query heads read (docs/mapping-schema.md, "
        "uneven world sizes)",
    )

    _v_size = field_validator("size")(lambda v: v if v is None else _check_expr(v))
    _v_heads = field_validator("heads", "query_heads")(lambda v: v if v is None else _check_expr(v))

    @model_validator(mode="after")
    def _one_of(self):
        if self.size is None and self.heads is None:
            raise ValueError("a section needs 'size' or 'heads' (or both)")
        if self.query_heads is not None and self.heads is None:
            raise ValueError("'query_heads' says whose key/value heads 'heads' are: give 'heads' too")
        return self


class _Layout(_Strict):
    """How the features along the split dim are laid out (shared by Column, Row, Param and Norm)."""
    sections: StrictInt | list[Section] | CheckedExpr | None = Field(
        None,
        description="the split dimension is a concatenation of blocks, each split on its own and regrouped "
        "per rank: a number N (or an expression, e.g. moe_num_experts) for N equal blocks ([gate | up] is 2), "
        "or a list of sections with sizes",
    )
    heads: Expr | None = Field(
        None,
        description="attention heads along the split dimension (per section when sections are equal); splits "
        "on head boundaries and checks the world size divides the heads",
    )
    query_heads: Expr | None = Field(
        None, description="key/value heads: the query heads (expression) that share these heads, query head j "
        "reading head j // (query_heads / heads) (GQA). Needed at a world size that splits the query heads "
        "unevenly: each rank then holds every key/value head its query heads read (docs/mapping-schema.md, "
        "uneven world sizes)",
    )
    interleaved: StrictBool = Field(
        False,
        description="the N equal sections of 'sections: N' are interleaved feature by feature ([a0 b0 a1 b1 "
        "...], gpt-oss's gate_up_proj) instead of stored one after the other: each rank keeps features j of every "
        "section, still interleaved (a split of the N-wide features j, so no pair is ever cut)",
    )
    groups: Expr | None = Field(
        None,
        description="the split dimension is this many equal groups, each laid out by 'sections' (Falcon's "
        "[kv, q_per_kv + 2, d]; DBRX's experts stacked [E * I, H]). Groups are dealt out like heads: whole "
        "groups per rank, or, with fewer groups than ranks, each group's sections split over the ranks "
        "that share it; at any other world size, whole groups by the balanced rule (more groups than ranks) or "
        "the groups' query heads split as heads, each rank holding every group they read with its one-head "
        "sections repeated per copy (fewer; docs/mapping-schema.md)",
    )

    _v_heads = field_validator("heads", "groups", "query_heads")(lambda v: v if v is None else _check_expr(v))

    def _check_layout(self, fused: bool = False):
        if isinstance(self.sections, str):
            return  # a count given by an expression: checked when evaluated
        n = self.sections if isinstance(self.sections, int) else len(self.sections or [])
        if self.sections is not None and n < 2:
            raise ValueError("'sections' needs at least 2 blocks; leave it out for an unfused weight")
        if self.interleaved and (not isinstance(self.sections, int) or self.heads is not None
                                 or self.groups is not None):
            raise ValueError("interleaved: true needs 'sections: N' (a number: the sections interleaved feature "
                             "by feature) and no 'heads' or 'groups'")
        if fused and self.sections is not None and n != 3:
            raise ValueError(f"combined_qkv means 3 sections [q | k | v], but 'sections' gives {n}")
        if isinstance(self.sections, list) and (self.heads is not None or self.query_heads is not None):
            raise ValueError("give 'heads' (and 'query_heads') per section when the sections are listed, not on "
                             "the entry")
        if self.query_heads is not None and self.heads is None and not isinstance(self.sections, list):
            raise ValueError("'query_heads' says whose key/value heads 'heads' are: give 'heads' too")

    def section_specs(self) -> list[tuple[Any, Any]]:
        """The blocks along the split dimension (of one group) as (size, heads) expressions, None where
        unstated (`query_specs` gives each block's query_heads).

        An unfused weight is one block. Blocks without a size share what the sized blocks leave, in
        proportion to their heads (1 each when no heads are given): equal [q | k | v] thirds, or GQA
        [q | k | v] from head counts alone.
        """
        if isinstance(self.sections, list):
            return [(s.size, s.heads) for s in self.sections]
        n = 3 if getattr(self, "combined_qkv", False) and self.sections is None else (self.sections or 1)
        return [(None, self.heads)] * n

    def query_specs(self) -> list[Any]:
        """Each block's query_heads expression (None where unstated), in the order of `section_specs`."""
        if isinstance(self.sections, list):
            return [s.query_heads for s in self.sections]
        return [self.query_heads] * len(self.section_specs())


class _Sharded(_Layout, _Entry):
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

    @model_validator(mode="after")
    def _fusion(self):
        self._check_layout(self.combined_qkv)
        return self


class Column(_Sharded):
    """Split the output features: rank r holds rows [r] of an nn.Linear weight (columns of A in Y = XA)."""
    kind: Literal["Column"]
    gather_output: StrictBool = Field(
        False, description="all-gather the output back to the full width (in the original feature order)"
    )
    copy_input: StrictBool = Field(
        True, description="false when the input already entered the tensor-parallel region upstream (an Enter "
        "entry), so its gradient must not be all-reduced a second time (DeepSeek's MLA kv_b_proj)"
    )


class Row(_Sharded):
    """Split the input features; the partial outputs are all-reduced and the bias is added once."""
    kind: Literal["Row"]


class Update(_Entry):
    """Set module attributes to per-rank values.

    Keys are attribute paths on the matched module; a path through ``config`` (``config.num_attention_heads``)
    gives the module its own copy of the config, so the model's shared config keeps the full sizes.
    """
    kind: Literal["Update"]
    module: Pattern = Field(description="modules whose attributes change")
    attributes: dict[AttributePath, CheckedExpr] = Field(
        min_length=1, description="attribute path -> per-rank value (expression), e.g. num_heads: n_head // tp_size"
    )


class Param(_Layout, _Entry):
    """Split bare tensors of a module along `dim`: rank r keeps pieces [r] (same layout rules as Column).

    For tensors a module uses directly instead of through an nn.Linear: 3-D expert weights
    (``gate_up_proj [E, 2I, H]`` split on dim 1 with ``sections: 2``), attention ``sinks [H]``, Mamba's
    ``A_log [I, N]``, a depthwise conv's ``weight [C, 1, K]`` (with an Update of ``groups``). A ModuleList
    named in ``params`` keeps this rank's items (dim 0); an item two ranks hold (a per-KV-head norm whose
    head both read) has its gradient summed over its holders. No collective is added to the forward: the
    module must read its input already split (after a Column) or sit inside a ``Reduce``.

    ``partial: true`` (no dim): the tensor is a term of a partial sum that a ``Reduce`` (or Row) sums over
    ranks -- e.g. a bias added inside every expert's output. Rank 0 keeps it, the others hold zeros (and
    their gradients are zeroed), so the sum adds it once: ``sum_r (y_r + b [r == 0]) = y + b``.

    Example: ``{kind: Param, module: "layers.*.mlp.experts", params: [gate_up_proj], dim: 1, sections: 2}``
    gives each rank ``[E, 2I/tp_size, H]`` = ``[gate_r | up_r]`` of every expert.
    """
    kind: Literal["Param"]
    module: Pattern = Field(description="modules that own the tensors")
    params: list[Annotated[str, AfterValidator(_check_attribute_path)]] = Field(
        min_length=1, description="names of parameters, buffers or ModuleLists directly on the module"
    )
    dim: StrictInt | None = Field(None, description="the dim to split (negative counts from the end)")
    partial: StrictBool = Field(
        False, description="a term of a partial sum: kept on rank 0, zeros on the others (no dim)"
    )
    replicate_heads: StrictBool = Field(
        True, description="false: with fewer heads than ranks, refuse the world size (naming those that work) "
        "instead of holding a head on several ranks -- for heads whose copies would count twice (JetMoE's key/value "
        "heads, on which its query heads ride, inside a partial sum)",
    )

    @model_validator(mode="after")
    def _dim_or_partial(self):
        self._check_layout()
        if self.partial and (self.dim is not None or self.sections is not None or self.heads is not None
                             or self.groups is not None):
            raise ValueError("partial: true keeps the whole tensor on rank 0; remove dim/sections/heads/groups")
        if not self.partial and self.dim is None:
            raise ValueError("a Param entry needs 'dim' (the dim to split), or partial: true")
        return self


class Reduce(_Entry):
    """Sum a module's partial output over the ranks: ``Y = sum_r f_r(X)``.

    For a module whose parameters are split by ``Param`` entries so that each rank computes a partial
    sum (the experts of an MoE block: TP inside every expert, one all-reduce for all of them). Its
    floating-point tensor inputs enter through ``copy_to_tp_region`` (identity forward, all-reduce of
    the gradient backward, as a Column's input) and its output -- a tensor, or the first tensor of a
    tuple -- leaves through ``reduce_from_tp_region`` (all-reduce forward, identity backward, as a Row's).
    """
    kind: Literal["Reduce"]
    module: Pattern = Field(description="modules whose output is a partial sum on every rank")


class Enter(_Entry):
    """A module kept whole whose output enters the tensor-parallel region: ``copy_to_tp_region`` on its
    output (identity forward, all-reduce of the gradient backward).

    For a replicated module whose output is consumed by this rank's heads directly, not only through
    Columns: DeepSeek's MLA ``kv_a_proj_with_mqa`` output [c_kv | k_rope], whose rope part every rank
    applies to its own heads (a partial gradient). The Columns downstream of it then set
    ``copy_input: false``, and replicated modules in between (a norm) need ``grad_allreduce``.
    """
    kind: Literal["Enter"]
    module: Pattern = Field(description="modules whose output gradient is partial on every rank")


class Input(_Entry):
    """Slice a tensor argument of a module's forward by heads, before the module runs.

    For tensors that a parent builds with the *global* head count and passes down (ALiBi biases:
    BLOOM's ``alibi [B*H, 1, S]``, MPT's ``position_bias [H, 1, S]``, Falcon's ``[B, H, S, S]`` mask):
    rank r keeps the heads its attention holds. ``flattened: true`` when `dim` holds batch x heads
    (batch-major), viewed as ``[B, H]`` to slice. A dim of size 1 (a broadcast) is left whole.
    """
    kind: Literal["Input"]
    module: Pattern = Field(description="modules whose forward receives the argument")
    argument: Annotated[str, AfterValidator(_check_attribute_path)] = Field(
        description="the forward argument's name (keyword or positional)"
    )
    dim: StrictInt = Field(description="the dim that holds the heads (negative counts from the end)")
    heads: CheckedExpr = Field(description="heads along that dim in the full tensor (expression)")
    flattened: StrictBool = Field(False, description="the dim holds batch x heads, batch-major (BLOOM's alibi)")


class Route(_Entry):
    """Expert parallelism: each rank holds whole experts and runs the tokens routed to them.

    The experts' stacked tensors ([E, ...]) are dealt out on dim 0 by a Param entry with ``heads: <E>`` (E // ws
    experts per rank, or one more on the first ranks), and a Reduce on the same module sums the ranks' outputs
    (its inputs' gradients all-reduced: the hidden states and the routing weights). The Route entry rewrites
    the module's routing arguments before it runs, after the Reduce's: the expert ids in ``index`` become this
    rank's local ids, an expert held elsewhere becomes the sentinel id E_r (this rank's expert count, which
    transformers' experts implementations skip), and its routing weight in ``weights`` is zeroed. Every rank
    computes the same routing (the router is replicated), so each token's top-k experts run exactly once
    over all ranks, and a token routed to two experts of one rank is counted for both.
    """
    kind: Literal["Route"]
    count: CheckedExpr = Field(description="the number of experts (expression), e.g. num_local_experts")
    index: Annotated[str, AfterValidator(_check_attribute_path)] = Field(
        "top_k_index", description="the forward argument holding the chosen expert ids (..., k)")
    weights: Annotated[str, AfterValidator(_check_attribute_path)] | None = Field(
        "top_k_weights", description="the forward argument holding the routing weights (..., k), zeroed where the "
        "expert is held by another rank (null: the module takes none)")


class Norm(_Layout, _Entry):
    """An RMSNorm / LayerNorm / L2 norm over features that are split over the ranks, computed exactly.

    ``rms``: ``y = x / sqrt(mean(x^2) + eps) * w``; ``layer``: ``y = (x - mean(x)) / sqrt(var(x) + eps) * w + b``;
    ``l2``: ``y = x / sqrt(sum(x^2) + eps) [* w]`` (a projection onto the unit sphere, as nGPT's, often without a
    weight), all over the *full* last dim, in float32. Rank r holds x_r (a Column's output) and w_r; the sums
    sum(x_r) and sum(x_r^2) are all-reduced in forward, and their gradients all-reduced in backward
    (every rank's output depends on every rank's statistic). The weight is split with its features
    (``heads``/``sections``), so its gradient needs no collective. ``eps`` is read from the module's
    ``variance_epsilon`` or ``eps``. For norms over one head (``[head_dim]``), use ``grad_allreduce``.

    ``group_size`` takes the statistic per group of that many consecutive features instead (Mamba-2's gated
    norm, one statistic per SSM group): where every rank holds whole groups it is computed locally, with no
    collective; where a group spans ranks (fewer groups than ranks, or an uneven split of its heads) the
    per-group sums are all-reduced. ``gate: silu`` is for norms called as ``norm(x, gate)`` that take
    ``x * silu(gate)`` before the statistic (Mamba-2's ``RMSNormGated``); the gate is split like x.
    """
    kind: Literal["Norm"]
    statistic: Literal["rms", "layer", "l2"] = Field(
        description="rms: RMSNorm; layer: LayerNorm (mean subtracted); l2: x / sqrt(sum(x^2) + eps), the module "
        "may have no weight (then its entry takes no heads/sections: there is nothing to lay out)")
    group_size: CheckedExpr | None = Field(
        None, description="the statistic is taken per group of this many consecutive features of the full dim "
        "(expression; Mamba-2's gated norm: num_heads * head_dim // n_groups), not over the whole dim. Ranks that "
        "hold whole groups compute them locally; a group split over ranks has its sums all-reduced")
    gate: Literal["silu"] | None = Field(
        None, description="the module is called as norm(x, gate) and normalizes x * silu(gate) (Mamba-2's gated "
        "RMSNorm, the gate applied before the statistic); the gate is this rank's slice, split like x")

    @model_validator(mode="after")
    def _layout(self):
        self._check_layout()
        if self.statistic == "l2" and (self.group_size is not None or self.gate is not None):
            raise ValueError("'group_size' and 'gate' are for rms and layer norms, not 'l2'")
        return self


Entry = Annotated[Column | Row | Update | Param | Reduce | Enter | Input | Norm | Route, Field(discriminator="kind")]
KIND_CLASSES = {cls.model_fields["kind"].annotation.__args__[0]: cls
                for cls in (Column, Row, Update, Param, Reduce, Enter, Input, Norm, Route)}


class TokenRun(_Strict):
    """A run of one token id placed into every row of an ``ids`` example input, for the placeholders a
    model replaces by other features (the image tokens a multimodal model fills with its projected image
    features). Runs are placed back to back from position 1 of every row; the id appears nowhere else."""
    id: InputExpr = Field(description="the token id (expression), e.g. image_token_id")
    count: InputExpr = Field(
        description="tokens per row (expression), by the model's own rule, e.g. the patches of one image: "
        "(vision_config.image_size // vision_config.patch_size) * (vision_config.image_size // "
        "vision_config.patch_size)"
    )


class ExampleInput(_Strict):
    """One example input of a verify config: a tensor of this shape, filled according to its kind."""
    shape: list[InputExpr] = Field(
        min_length=1, description="dimensions, integer expressions over config attributes (dotted names reach a "
        "sub-config: vision_config.image_size) and `batch` / `seq` (the batch size and sequence length of the "
        "derived inputs), e.g. [batch, num_mel_bins, 2 * max_source_positions]"
    )
    kind: Literal["ids", "float", "mask", "values", "grid", "bool"] = Field(
        "ids", description="ids: random token ids in [3, vocab_size); float: standard normal values; mask: ones, "
        "with the last row's last 3 positions 0 (right padding); values: integers given by `values` (sizes a "
        "model reads, such as an image's height and width); grid: the (x, y) coordinates of the cells of a "
        "`grid` [width, height], row by row (patch positions on an image), or float patches led by their row and "
        "column when a float input has a `grid`; bool: True everywhere (a mask of "
        "real entries a model indexes with, such as the tiles of an image)"
    )
    tokens: list[TokenRun] = Field(
        [], description="(ids) runs of special token ids placed in every row from position 1, e.g. image "
        "placeholders: [{id: image_token_id, count: N}]"
    )
    values: list[InputExpr] = Field(
        [], description="(values) integer expressions, as many as the last dimension: every row holds them, e.g. "
        "image_sizes {shape: [batch, 2], kind: values, values: [vision_config.image_size, 2 * "
        "vision_config.image_size]} (height, width)"
    )
    grid: list[InputExpr] = Field(
        [], description="(grid) [width, height], integer expressions: the input's last two dimensions are "
        "width * height cells and their (x, y), x = i % width and y = i // width for cell i, in every row, e.g. "
        "image_position_ids {shape: [batch, 16, 2], kind: grid, grid: [4, 4]}. (float) the input is flattened "
        "patches [..., width * height, 2 + features] led by their position: patch i's first two entries are its "
        "row i // width + 1 and column i % width + 1 (from 1, 0 marking a padding patch, as the processors that "
        "write such patches do), the rest standard normal, e.g. flattened_patches {shape: [batch, 16, 2 + 48], "
        "kind: float, grid: [4, 4]}"
    )

    @model_validator(mode="after")
    def _tokens_in_ids(self):
        if self.tokens and self.kind != "ids":
            raise ValueError(f"tokens are placed into token ids; this input's kind is {self.kind!r}")
        if (self.kind == "values") != bool(self.values):
            raise ValueError("kind: values needs `values` (one expression per element of the last dimension), "
                             f"and only it takes them; this input's kind is {self.kind!r}")
        if ((self.kind == "grid") != bool(self.grid) and self.kind != "float") or (self.grid and len(self.grid) != 2):
            raise ValueError("kind: grid needs `grid: [width, height]` (two expressions), and only it and kind: float "
                             "(patches whose first two features are their row and column) take one; this input's "
                             f"kind is {self.kind!r}, its grid {len(self.grid)} values")
        return self


class Tolerance(_Strict):
    """A verify config's own forward bound: sharding reorders float sums, and a model that amplifies rounding
    (a recurrent scan) can exceed the default 1e-5 on a tiny config while float64 agrees to ~1e-15."""
    forward: float = Field(gt=1e-5, le=1e-3, description="max|sharded - unsharded| / max|unsharded| allowed, fp32")
    reason: str = Field(min_length=20, description="why: the model's rounding, with the measured values "
                        "(fp32 and float64), so a reviewer can tell it from a sharding bug")


class Verify(_Strict):
    """An embedded tiny configuration that `tpmap verify` and the tests build (no download)."""
    name: str = Field("default", description="a short name for this configuration in reports")
    config: dict[str, Any] = Field(
        description="overrides for AutoConfig.for_model(model_type); keep it tiny, with head counts that "
        "divide the world sizes you claim (12 heads cover 1, 2, 3, 4)"
    )
    models: list[str] = Field(min_length=1, description="transformers class names to build, e.g. LlamaForCausalLM")
    world_sizes: list[WorldSize] = Field([1, 2, 4], description="world sizes `tpmap verify` runs")
    inputs: dict[str, ExampleInput] = Field(
        {}, description="example inputs by forward argument name, added to (or replacing) those derived from the "
        "model class: input_ids + attention_mask when its main input is input_ids, decoder_input_ids for an "
        "encoder-decoder. A main input other than input_ids must be declared (Whisper's input_features)"
    )
    grad_mode: Literal["eval", "train"] = Field(
        "eval", description="the mode the gradient checks run the models in: train sets every dropout "
        "probability to 0 first, for models whose backward needs training mode (Reformer's reversible layers "
        "assert it; RWKV's eval forward updates its recurrent state in place)"
    )
    tolerance: Tolerance | None = Field(
        None, description="a looser forward bound than tpmap verify's 1e-5 relative, for a model whose own fp32 "
        "rounding exceeds it on this config (with the measurement and the float64 result as the reason)"
    )
    not_checked: dict[Literal["grad_fp64", "generate"], str] = Field(
        {}, description="checks CI cannot run on this config because the unsharded transformers model itself fails "
        "them, with the reason (grad_fp64: an attention that builds a float32 constant; generate: a model whose own "
        "generate fails). CI proves the claim: it runs the check on the unsharded model and fails when that "
        "succeeds, so a stale entry is noticed"
    )


class OwnParams(_Strict):
    """Parameters held directly by a module whose children are split, used whole by every rank on its shard of the
    activations (a `grad_allreduce` item): their gradients are summed over the ranks. For a module that keeps
    everything whole, the plain pattern says the same.

    Example (DiffLlama: the lambdas scale the output of every head pair, and each rank holds some pairs)::

        grad_allreduce:
          - module: layers.*.self_attn
            params: [lambda_q1, lambda_k1, lambda_q2, lambda_k2]
    """
    module: Pattern
    params: list[str] = Field(min_length=1, description="names of parameters the module holds itself")
    transformers: ReleaseRange = Field(
        None, description="the transformers releases this item applies to (as an entry's `transformers`): a "
        "module a release renamed gets one item per name"
    )

    _v_module = field_validator("module")(lambda v: _check_pattern(v))


class KeptWhole(_Strict):
    """A block that a complete tensor-parallel mapping would split, kept whole on every rank because the
    model's code does not allow splitting it (e.g. an attention that reshapes its output by its input
    width, LSH rotations drawn per head count). Unlike a plain `replicated` pattern (a router, a small
    low-rank projection: replicated by design, as in Megatron), a kept-whole block makes the mapping
    *partial*: `tpmap.apply` warns once naming it, and `tpmap verify` / MODELS.md report the per-rank
    share of the parameters.

    Example::

        replicated:
          - module: layers.*.rel_attn
            reason: the output projection is an einsum followed by residual + LayerNorm in one module
    """
    module: Pattern
    reason: str = Field(min_length=1, description="why it cannot be split, naming the code that prevents it")

    _v_module = field_validator("module")(lambda v: _check_pattern(v))


class Unsupported(_Strict):
    """A config variant the mapping cannot shard correctly: `tpmap.apply` and lint refuse it, saying why,
    instead of returning wrong numbers (e.g. BLOOM's ``slow_but_exact`` path slices the Row weights
    into direct F.linear calls that bypass the Row's all-reduce)."""
    when: When
    reason: str = Field(min_length=1, description="why, and what to set instead")


class VocabParallel(_Strict):
    """Split the vocabulary of the input embedding and the LM head over the ranks (Megatron's
    VocabParallelEmbedding and parallel LM head). Both are found through transformers' own API
    (``get_input_embeddings()`` / ``get_output_embeddings()``), so no pattern is needed; every module
    that shares the embedding's weight (tied heads, per-stack copies) shares the one sharded weight.
    A vocabulary that the world size does not divide is padded; padded logits never reach outputs."""
    embedding: StrictBool = Field(
        True, description="rank r holds rows [r*V/tp_size, (r+1)*V/tp_size) of the input embedding: masked lookup + "
        "all-reduce"
    )
    lm_head: StrictBool = Field(
        True, description="rank r computes the logits of its vocabulary rows; they are all-gathered (full logits "
        "on every rank) unless tpmap.apply(..., loss_parallel=True) keeps them split for the loss"
    )


def _check_module_path(value: str) -> str:
    _check_pattern(value)
    if any(c in value for c in "*?["):
        raise ValueError(f"compose module {value!r} is a pattern; name one module (a dotted path, no globs)")
    return value


class Compose(_Strict):
    """Another mapping applied to one sub-model, under its module path (a vision tower, a language model).

    The composed file's ``entries``, ``replicated``, ``grad_allreduce`` and ``unsupported`` apply to the
    sub-model: its patterns stay relative to the sub-model's own base model, and its expressions and
    ``when`` read the sub-config. Its ``vocab_parallel``, ``verify``, ``world_sizes`` and
    ``default_config`` are not used: the composing file decides those for the whole model.

    Example (a vision tower and a language model, each mapped by its own file)::

        compose:
          - {module: language_model, config: text_config}    # mappings/<text_config.model_type>.yaml
          - {module: vision_tower, config: vision_config}
    """
    module: str = Field(description="the sub-model's module path, relative to the base model like every pattern "
                        "(one module, no globs)")
    config: AttributePath = Field(
        description="the attribute of this model's config that holds the sub-model's config (text_config, "
        "vision_config): the composed file's expressions and `when` are evaluated in it"
    )
    mapping: str | None = Field(
        None, description="the mapping to apply: a shipped model type (llama), or a path ending in .yaml, "
        "relative to this file; default: the sub-config's own model_type"
    )
    optional: bool = Field(
        False, description="the sub-model may be absent: where the config holds no sub-config at `config` (null, "
        "a checkpoint built without that tower) and the model has no module at `module`, the item composes "
        "nothing; a sub-config present without its module (or the reverse) is still an error"
    )

    _v_module = field_validator("module")(lambda v: _check_module_path(v))


class Mapping(_Strict):
    """A whole mapping file."""
    model_type: str = Field(description="the transformers config.model_type this file maps")
    world_sizes: list[WorldSize] = Field(
        [1, 2, 4, 8], description="world sizes the mapping supports on the default config of the model type"
    )
    default_config: dict[str, Any] = Field(
        {}, description="values that transformers' default config of this model type lacks to build at all "
        "(a transformers bug, e.g. DBRX in 5.24 reads attn_config.rope_theta that its config does not define); "
        "lint applies them to the default config it checks `world_sizes` on. Real checkpoints carry their own."
    )
    transformers: ReleaseRange = Field(
        None, description="the transformers releases this mapping needs, a PEP 440 range such as '>=5.24', where "
        "it is narrower than tpmap's own (the model type or a module attribute it relies on appeared in a later "
        "release): lint and verify skip the file on other releases, saying so, and apply refuses it"
    )
    config_defaults: dict[str, Any] = Field(
        {}, description="attributes that a config of this model type may lack and that the model reads with a "
        "default (DeBERTa-v2's getattr(config, 'share_att_key', False)), with that default: `when` conditions and "
        "expressions read it where the config lacks the attribute. Lint refuses a `when` on an attribute that the "
        "config class does not define unless it is declared here; an absent attribute without a default reads null"
    )
    unsupported: list[Unsupported] = Field(
        [], description="config variants refused by apply and lint, each with its reason"
    )
    replicated: list[Pattern | KeptWhole] = Field(
        [], description="modules kept whole on every rank on purpose (read by `tpmap lint` coverage): a pattern "
        "for a module replicated by design (a router), or {module, reason} for a block a complete mapping would "
        "split (the mapping is then partial and `tpmap.apply` warns naming it)"
    )
    compose: list[Compose] = Field(
        [], description="other mappings applied to sub-models (a vision tower, a language model) under their module "
        "paths, with their expressions evaluated in the sub-configs; `entries` then map the parts in between"
    )
    entries: list[Entry] = Field(
        [], description="the TensorParallelismInfo entries (at least one, unless `compose` maps the model)"
    )
    vocab_parallel: VocabParallel | None = Field(
        None, description="split the embedding and LM head along the vocabulary (omit to keep them replicated)"
    )
    grad_allreduce: list[Pattern | OwnParams] = Field(
        [],
        description="modules kept whole whose parameters see only this rank's shard of the activations (e.g. a "
        "per-head q/k norm applied to local heads): their gradients are summed over the ranks in backward; "
        "{module, params} names parameters of a module whose children are split (DiffLlama's lambdas)",
    )
    refuse_sequence_parallel: str | None = Field(
        None, min_length=20, description="why `sequence_parallel=True` cannot run this model although the engine's "
        "own checks accept it (a block reads a per-token tensor in a layout tpmap does not split, such as Mllama's "
        "[B, 1, T, 1] row mask): apply then refuses it with this reason before changing anything, instead of "
        "failing at the first forward. The composing file's own field decides for a composed model"
    )
    uneven: StrictBool = Field(
        False, description="the mapping is proven at world sizes that split its heads or features unevenly (rank r "
        "holding n // tp_size or one more; docs/mapping-schema.md, uneven world sizes): its Updates are per rank "
        "and a test proves it at such a world size. Without it an uneven world size is refused, naming the world "
        "sizes that split the model evenly"
    )
    experts: Placement | None = Field(
        None, description="the default placement of the MoE experts where entries are given for both (`experts` "
        "on an entry): split or parallel; tpmap.apply(experts=...) chooses the other"
    )
    verify: list[Verify] = Field(
        min_length=1, description="tiny configurations to prove the mapping on (e.g. GQA, and MHA for world size 3)"
    )

    _v_replicated = field_validator("replicated", "grad_allreduce")(
        lambda v: [_check_pattern(p) if isinstance(p, str) else p for p in v])

    @model_validator(mode="after")
    def _something_to_map(self):
        if not self.entries and not self.compose:
            raise ValueError("a mapping needs at least one entry (or a compose item)")
        return self

    @model_validator(mode="after")
    def _placements(self):
        tagged = {e.experts for e in self.entries if e.experts is not None}
        if tagged and self.experts is None:
            raise ValueError(f"entries are given for the experts placement {' and '.join(sorted(tagged))}: set the "
                             "mapping's default, `experts: split` or `experts: parallel`")
        if self.experts is not None and self.experts not in tagged and not self.compose:
            raise ValueError(f"experts: {self.experts} is the default placement, but no entry is given for it (an "
                             f"entry with `experts: {self.experts}`)")
        return self

    @property
    def replicated_patterns(self) -> list[str]:
        """Every `replicated` pattern, plain or kept whole."""
        return [p if isinstance(p, str) else p.module for p in self.replicated]

    @property
    def kept_whole(self) -> list[KeptWhole]:
        """The blocks that make this mapping partial (`replicated` items with a reason)."""
        return [p for p in self.replicated if isinstance(p, KeptWhole)]


def json_schema() -> dict:
    """The JSON Schema of a mapping file, generated from `Mapping` (what `tpmap schema` prints and
    ``mappings/mapping.schema.json``, beside the shipped YAML files that reference it, holds)."""
    schema = Mapping.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema, "title": "tpmap mapping file"}
