"""A tiny, safe integer expression language for sizes in mapping files.

Grammar (nothing else is accepted; the text is parsed, never `eval`-ed)::

    expr := INT | NAME | NAME.NAME... | expr (+ | - | * | //) expr | ( expr ) | per_rank( expr )

* NAME is a config attribute (``num_key_value_heads``, ``n_embd``; aliases from the config's
  ``attribute_map`` work; a name the config lacks is read from the one sub-config that has it, e.g.
  DBRX's ``ffn_config.moe_num_experts``) or one of the per-rank names ``tp_size`` and ``tp_rank``.
  A dotted name reads an attribute of a sub-config by its path (``vision_config.image_size``).
* ``a // b`` must divide exactly; otherwise evaluation fails with a `DivisibilityError` that names
  both numbers. A silently floored head count is the classic wrong-output bug, so there is none.
* ``per_rank(n)`` is how many of ``n`` heads one rank holds under tpmap's head rule: ``n // tp_size``
  when ``tp_size`` divides ``n``, else 1 when ``n`` divides ``tp_size`` (each head is replicated on
  ``tp_size // n`` ranks, as vLLM does for KV heads), else an error.

Example: ``per_rank(num_attention_heads) // per_rank(num_key_value_heads)`` is the number of query
heads per KV head on one rank (Llama's ``num_key_value_groups``), also when KV heads are replicated.
"""
from __future__ import annotations

import ast
from collections.abc import Callable

from tpmap.language.errors import DivisibilityError, TpmapError

PER_RANK_NAMES = ("tp_size", "tp_rank")
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
        and len(node.args) == 1
        and not node.keywords
    ):
        _check(node.args[0], text)
        return
    if isinstance(node, ast.BinOp) and type(node.op) in _OTHER_OPS:
        op = _OTHER_OPS[type(node.op)]
        hint = "; write // for an exact integer division" if op == "/" else ""
        raise ExpressionError(
            f"operator {op!r} is not allowed in expression {text!r}{hint} "
            "(allowed: integers, config attribute names, tp_size, tp_rank, + - * //, parentheses, per_rank(...))"
        )
    part = ast.get_source_segment(text, node) or type(node).__name__
    raise ExpressionError(
        f"{part!r} is not allowed in expression {text!r}; "
        "use integers, config attribute names, tp_size, tp_rank, + - * //, parentheses and per_rank(...)"
    )


def dotted(node: ast.AST) -> str | None:
    """'a.b.c' for an attribute chain on a plain name (a sub-config's attribute), else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if parts and isinstance(node, ast.Name) else None


def names(text: str | int) -> set[str]:
    """The names an expression reads (config attributes, dotted sub-config attributes and per-rank names;
    not the function per_rank)."""
    out: set[str] = set()

    def walk(node: ast.AST) -> None:
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(dotted(node))
        elif isinstance(node, ast.Call):  # per_rank(...): its argument, not the function's name
            for arg in node.args:
                walk(arg)
        else:
            for child in ast.iter_child_nodes(node):
                walk(child)

    walk(parse(text))
    return out


def per_rank(n: int, tp_size: int, what: str = "heads") -> int:
    """Heads held by one rank: split when tp_size divides n, one replicated head when n divides tp_size."""
    if n % tp_size == 0:
        return n // tp_size
    if tp_size % n == 0:
        return 1
    raise DivisibilityError(
        f"{n} {what} cannot be spread over world size {tp_size}: neither divides the other. "
        f"Use a world size that divides {n} or is a multiple of it."
    )


def evaluate(text: str | int, lookup: Callable[[str], int], tp_size: int = 1, tp_rank: int = 0) -> int:
    """Evaluate with `lookup(name)` for config attributes (it raises for unknown names)."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = node.id if isinstance(node, ast.Name) else dotted(node)
            if name == "tp_size":
                return tp_size
            if name == "tp_rank":
                return tp_rank
            value = lookup(name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ExpressionError(f"config attribute {name!r} is {value!r}, not an integer")
            return value
        if isinstance(node, ast.Call):  # per_rank(...), the only call _check lets through
            return per_rank(ev(node.args[0]), tp_size)
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
