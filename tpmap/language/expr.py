"""A tiny, safe integer expression language for sizes in mapping files.

Grammar (nothing else is accepted; the text is parsed, never `eval`-ed)::

    expr := INT | NAME | NAME.NAME... | expr (+ | - | * | //) expr | ( expr ) | per_rank( expr [, expr] )
          | at_layer( NAME | NAME.NAME... )

* NAME is a config attribute (``num_key_value_heads``, ``n_embd``; aliases from the config's
  ``attribute_map`` work; a name the config lacks is read from the one sub-config that has it, e.g.
  DBRX's ``ffn_config.moe_num_experts``) or one of the per-rank names ``tp_size`` and ``tp_rank``.
  A dotted name reads an attribute of a sub-config by its path (``vision_config.image_size``).
* ``a // b`` must divide exactly; otherwise evaluation fails with a `DivisibilityError` that names
  both numbers. A silently floored head count is the classic wrong-output bug, so there is none.
* ``per_rank(n)`` is how many of ``n`` heads *this* rank (``tp_rank``) holds under tpmap's head rule
  (`rank_heads`): ``n // tp_size`` when ``tp_size`` divides ``n``; 1 when ``n`` divides ``tp_size``
  (each head is replicated on ``tp_size // n`` ranks, as vLLM does for KV heads); else, with more
  heads than ranks, the balanced uneven split: ``n // tp_size``, plus one on the first
  ``n % tp_size`` ranks (9 heads at world size 2: 5 and 4).
* ``per_rank(kv, q)``: how many key/value heads this rank holds for its share of ``q`` query heads
  (``kv`` divides ``q``; query head j uses key/value head ``j // (q / kv)``), counting a head held
  twice (for two runs of query heads) twice; see `rank_heads`.

* ``at_layer(name)``: the entry of the config's per-layer list ``name`` at the layer of the module the
  expression is evaluated for (its name's first integer component, as for ``when_layer``): Laguna's
  ``at_layer(num_attention_heads_per_layer)`` is each layer's own query-head count. The caller gives the
  value (`evaluate`'s ``at_layer``); where there is no module, it is an error.

Example: ``per_rank(num_attention_heads) // per_rank(num_key_value_heads, num_attention_heads)`` is
the number of query heads per local KV head on this rank (Llama's ``num_key_value_groups``), also
when KV heads are replicated or the split is uneven. The older ``per_rank(num_key_value_heads)``
gives the same at a world size where every head count splits evenly.
"""
from __future__ import annotations

import ast
import math
from collections.abc import Callable, Mapping, Sequence

from tpmap.language.errors import DivisibilityError, TpmapError

PER_RANK_NAMES = ("tp_size", "tp_rank")
FUNCTIONS = ("per_rank", "at_layer")
MAX_CHARS = 256  # the longest shipped expression has ~60; bounds parsing and checking (no deep recursion)
MAX_VALUE = 2**63 - 1  # results must fit int64 (module attributes become tensor sizes)
_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//"}
_OTHER_OPS = {ast.Div: "/", ast.Mod: "%", ast.Pow: "**", ast.MatMult: "@", ast.LShift: "<<", ast.RShift: ">>",
              ast.BitOr: "|", ast.BitAnd: "&", ast.BitXor: "^"}


class ExpressionError(TpmapError):
    """The text is not in the expression grammar."""


def parse(text: str | int) -> ast.expr:
    """Parse and check an expression; raises ExpressionError naming the offending part."""
    if isinstance(text, bool):
        raise ExpressionError(f"expected an integer expression, got the boolean {text!r}")
    if isinstance(text, int):
        if abs(text) > MAX_VALUE:
            raise ExpressionError(f"the integer {str(text)[:20]}... does not fit int64")
        return ast.Constant(text)
    if len(str(text)) > MAX_CHARS:
        raise ExpressionError(f"an expression of {len(str(text)):,} characters (limit {MAX_CHARS}); "
                              "a size expression needs a few names and operators")
    try:
        tree = ast.parse(str(text), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:  # also "too many digits", deep nesting
        raise ExpressionError(f"cannot parse expression {text!r}: {getattr(e, 'msg', None) or e}") from None
    _check(tree, str(text))
    return tree


def _check(node: ast.AST, text: str) -> None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return
    if isinstance(node, ast.Name) or dotted(node):
        return
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        _check(node.left, text)
        _check(node.right, text)
        return
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "per_rank"
        and len(node.args) in (1, 2)
        and not node.keywords
    ):
        for arg in node.args:
            _check(arg, text)
        return
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "at_layer":
        arg = node.args[0] if len(node.args) == 1 and not node.keywords else None
        name = arg.id if isinstance(arg, ast.Name) else dotted(arg) if arg is not None else None
        if name is None or name in PER_RANK_NAMES:
            raise ExpressionError(f"{ast.get_source_segment(text, node) or 'at_layer'!r} in expression {text!r}: "
                                  "at_layer takes one config attribute name, a list with one entry per layer "
                                  "(e.g. at_layer(num_attention_heads_per_layer))")
        return
    if isinstance(node, ast.BinOp) and type(node.op) in _OTHER_OPS:
        op = _OTHER_OPS[type(node.op)]
        hint = "; write // for an exact integer division" if op == "/" else ""
        raise ExpressionError(
            f"operator {op!r} is not allowed in expression {text!r}{hint} "
            "(allowed: integers, config attribute names, tp_size, tp_rank, + - * //, parentheses, per_rank(...), "
            "at_layer(...))"
        )
    part = ast.get_source_segment(text, node) or type(node).__name__
    raise ExpressionError(
        f"{part!r} is not allowed in expression {text!r}; "
        "use integers, config attribute names, tp_size, tp_rank, + - * //, parentheses, per_rank(...) and "
        "at_layer(...)"
    )


def dotted(node: ast.AST) -> str | None:
    """'a.b.c' for an attribute chain on a plain name (a sub-config's attribute), else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if parts and isinstance(node, ast.Name) else None


def names(text: str | int) -> set[str]:
    """The names an expression reads (config attributes, dotted sub-config attributes and per-rank names; the
    lists at_layer reads; not the functions' names)."""
    out: set[str] = set()

    def walk(node: ast.AST) -> None:
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(dotted(node))
        elif isinstance(node, ast.Call):  # per_rank(...), at_layer(...): their arguments, not the function's name
            for arg in node.args:
                walk(arg)
        else:
            for child in ast.iter_child_nodes(node):
                walk(child)

    walk(parse(text))
    return out


def per_rank_calls(text: str | int) -> list[tuple[str, ...]]:
    """The argument texts of every per_rank(...) call in an expression: 'per_rank(a) // per_rank(b, a)' ->
    [('a',), ('b', 'a')]."""
    return [tuple(ast.unparse(a) for a in node.args) for node in ast.walk(parse(text))
            if isinstance(node, ast.Call) and node.func.id == "per_rank"]


def layer_lists(text: str | int) -> list[str]:
    """The per-layer lists an expression reads with at_layer(...): 'per_rank(at_layer(h)) * d' -> ['h']."""
    return [ast.unparse(node.args[0]) for node in ast.walk(parse(text))
            if isinstance(node, ast.Call) and node.func.id == "at_layer"]


def even(n: int, tp_size: int) -> bool:
    """Whether n heads follow the even rule at tp_size (split exactly, or each replicated on tp_size // n ranks)."""
    return n % tp_size == 0 or tp_size % n == 0


def rank_heads(n: int, tp_size: int, rank: int, query: int | None = None) -> list[int] | None:
    """The heads of `n` that `rank` holds, in local order (repeats included), or None where no rule applies.

    Plain heads (``query`` None or n): ``tp_size | n``: the block [r*n/tp, (r+1)*n/tp); ``n | tp_size``: head
    ``r // (tp_size / n)`` (vLLM's replication); ``n > tp_size``: the balanced block, ``n // tp_size`` heads
    plus one on the first ``n % tp_size`` ranks (9 at 2: [0..4], [5..8]); fewer heads than ranks that do
    not divide them: None (a rank would hold no head).

    Key/value heads for ``query`` query heads (``n | query``; query head j reads KV head ``j // (query/n)``):
    the rank's query heads Q_r (the plain rule on ``query``) read runs of equal KV heads; with g the gcd of
    the run lengths, every run of length m contributes its head m/g times, so that the local query heads
    are exactly ``repeat_interleave(local_kv, g)``: HF's ``repeat_kv`` with ``num_key_value_groups = g``.
    E.g. 9 query and 3 KV heads at 2 ranks: Q_0 = 0..4 reads KV [0,0,0,1,1] -> g 1, heads [0,0,0,1,1];
    Q_1 = 5..8 reads [1,2,2,2] -> heads [1,2,2,2]. When the query heads split evenly this equals the
    plain rule on n (whole blocks, or vLLM's replication).
    """
    if query is None or query == n:
        if n % tp_size == 0:
            per = n // tp_size
            return list(range(rank * per, (rank + 1) * per))
        if tp_size % n == 0:
            return [rank // (tp_size // n)]
        if n < tp_size:
            return None
        base, extra = divmod(n, tp_size)
        start = rank * base + min(rank, extra)
        return list(range(start, start + base + (rank < extra)))
    if n <= 0 or query % n:
        return None
    queries = rank_heads(query, tp_size, rank)
    if queries is None:
        return None
    group = query // n
    runs: list[list[int]] = []  # [kv head, run length] in query order
    for j in queries:
        if runs and runs[-1][0] == j // group:
            runs[-1][1] += 1
        else:
            runs.append([j // group, 1])
    g = math.gcd(*(m for _, m in runs))
    return [h for h, m in runs for _ in range(m // g)]


def per_rank(n: int, tp_size: int, what: str = "heads", rank: int = 0, query: int | None = None,
             uneven: bool = False) -> int:
    """Heads held by `rank` (`rank_heads`; KV heads of `query` query heads when given). Unless `uneven` (the
    plan splits something unevenly, so the caller checks that n is a head count it lays out), counts that
    only the uneven rule splits are refused, as before uneven splits existed."""
    if not uneven and not (n > 0 and even(n, tp_size) and (query is None or even(query, tp_size))):
        raise DivisibilityError(
            f"{n} {what} cannot be spread over world size {tp_size}: neither divides the other. "
            f"Use a world size that divides {n} or is a multiple of it.")
    heads = rank_heads(n, tp_size, rank, query) if n > 0 else None
    if heads is not None:
        return len(heads)
    if query is not None and (query <= 0 or n <= 0 or query % n):
        raise DivisibilityError(f"per_rank({n}, {query}): {n} key/value heads must divide the {query} query heads")
    fewer = query if query is not None and query < tp_size else n
    raise DivisibilityError(
        f"{fewer} {what} cannot be spread over world size {tp_size}: fewer heads than ranks, and they do not "
        f"divide the world size (a rank would hold none). Use a world size of at most {fewer} or a multiple of it."
    )


def evaluate(text: str | int, lookup: Callable[[str], int], tp_size: int = 1, tp_rank: int = 0,
             uneven: bool = False, held: Mapping[int, Sequence[int]] | None = None,
             at_layer: Callable[[str], object] | None = None) -> int:
    """Evaluate with `lookup(name)` for config attributes (it raises for unknown names); `uneven`: per_rank
    follows the uneven rule too (see `per_rank`). `held`: {feature count: what each rank holds of it} as the
    plan laid it out (stacked experts split in aligned units hold other counts than the balanced rule);
    ``per_rank(n)`` of such a count is this rank's. `at_layer(name)`: the entry of the per-layer list `name` at
    the layer of the module being planned (it raises where that cannot be read); None: there is no module, and
    an expression that calls at_layer is an error."""

    def integer(name: str, value) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ExpressionError(f"config attribute {name} is {value!r}, not an integer")
        return value

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = node.id if isinstance(node, ast.Name) else dotted(node)
            if name == "tp_size":
                return tp_size
            if name == "tp_rank":
                return tp_rank
            return integer(repr(name), lookup(name))
        if isinstance(node, ast.Call) and node.func.id == "at_layer":
            name = ast.unparse(node.args[0])
            if at_layer is None:
                raise ExpressionError(f"at_layer({name}) reads the layer of the module an entry is applied to, and "
                                      "this expression belongs to no entry's module (only an entry's expressions "
                                      "may call it)")
            return integer(f"{name}'s entry for this layer", at_layer(name))
        if isinstance(node, ast.Call):  # per_rank(...)
            query = ev(node.args[1]) if len(node.args) == 2 else None
            n = ev(node.args[0])
            if held and query is None and n in held:
                return held[n][tp_rank]
            return per_rank(n, tp_size, rank=tp_rank, query=query, uneven=uneven)
        assert isinstance(node, ast.BinOp), ast.dump(node)
        a, b = ev(node.left), ev(node.right)
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        if isinstance(node.op, ast.Mult):
            return a * b
        if b == 0 or a % b:
            raise DivisibilityError(
                f"{ast.unparse(node)} = {a} // {b} does not divide exactly (world size {tp_size})"
            )
        return a // b

    value = ev(parse(text))
    if abs(value) > MAX_VALUE:
        raise ExpressionError(f"{text!r} evaluates to {value}, which does not fit int64")
    return value
