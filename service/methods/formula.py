"""`calculate_output`, a multi grader's formula over its graders' scores: checked when the
grader is parsed (`formula`: a 400 for anything but numbers, the graders' names, `+ - * /
^`, parentheses and a few functions) and evaluated by `simpleeval` (an AST walker with no
access to Python's builtins), never by `eval` (`evaluate`)."""

from __future__ import annotations

import ast
import math

from service.errors import InvalidRequest

FORMULA_FUNCTIONS = {
    # floats throughout: an integer power of floor(4e6) would compute for minutes
    "min": min, "max": max, "abs": abs,
    "floor": lambda x: float(math.floor(x)), "ceil": lambda x: float(math.ceil(x)),
    "exp": math.exp, "sqrt": math.sqrt, "log": math.log,
}  # fmt: skip
_FORMULA_NODES = (
    ast.Expression, ast.BinOp, ast.UnaryOp, ast.Call, ast.Name, ast.Load, ast.Constant,
    ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow, ast.USub, ast.UAdd,
)  # fmt: skip
MAX_FORMULA_NODES = 256


def formula(text: str, names: set[str], param: str) -> None:
    """A 400 unless `calculate_output` parses as an allowed formula over `names` (it is
    parsed again where it is evaluated, `evaluate`: the grader keeps only its text)."""
    try:
        tree = ast.parse(text.replace("^", "**"), mode="eval")
    except SyntaxError as e:
        raise InvalidRequest(f"{param}: not a formula ({e.msg})", param=param) from None
    for node in ast.walk(tree):
        if not isinstance(node, _FORMULA_NODES) or (
            isinstance(node, ast.Constant) and not isinstance(node.value, int | float)
        ):
            raise InvalidRequest(
                f"{param}: {ast.unparse(node) if isinstance(node, ast.expr) else text!r} is "
                "not allowed in a formula: numbers, the graders' names, + - * / ^ and "
                f"{', '.join(FORMULA_FUNCTIONS)} only",
                param=param,
            )
        if isinstance(node, ast.Call) and not (
            isinstance(node.func, ast.Name) and node.func.id in FORMULA_FUNCTIONS
        ):
            only = ", ".join(FORMULA_FUNCTIONS)
            raise InvalidRequest(f"{param}: only {only} can be called", param=param)
        if isinstance(node, ast.Name) and node.id not in names | set(FORMULA_FUNCTIONS):
            raise InvalidRequest(
                f"{param}: {node.id!r} is neither one of the graders ({', '.join(sorted(names))}) "
                f"nor a function ({', '.join(FORMULA_FUNCTIONS)})",
                param=param,
            )
        if isinstance(node, ast.Call) and not _arity_ok(node):
            raise InvalidRequest(
                f"{param}: {ast.unparse(node)}: min and max take one or more values, the other "
                "functions one",
                param=param,
            )
    if sum(1 for _ in ast.walk(tree)) > MAX_FORMULA_NODES:
        raise InvalidRequest(
            f"{param}: more than {MAX_FORMULA_NODES} terms; a formula combines a few scores",
            param=param,
        )


def _arity_ok(call: ast.Call) -> bool:
    name = call.func.id if isinstance(call.func, ast.Name) else ""
    many = name in ("min", "max")
    return not call.keywords and (len(call.args) >= 1 if many else len(call.args) == 1)


def evaluate(text: str, scores: dict[str, float]) -> float | None:
    """The formula's value, or None where it has none (a division by zero, log(0), an
    overflow, a complex or non-finite result). Its numbers are floats, so a huge power
    overflows at once rather than building a huge integer; `formula` bounded its size."""
    from simpleeval import DEFAULT_OPERATORS, SimpleEval

    tree = ast.parse(text.replace("^", "**"), mode="eval")
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            node.value = float(node.value)
    ops = {k: v for k, v in DEFAULT_OPERATORS.items() if k is not ast.BitXor}
    floats = {k: float(v) for k, v in scores.items()}
    evaluator = SimpleEval(operators=ops, functions=FORMULA_FUNCTIONS, names=floats)
    try:
        value = float(evaluator.eval(text, previously_parsed=tree.body))
        return value if math.isfinite(value) else None
    except Exception:  # simpleeval's own (NumberTooHigh), arithmetic, math domain errors,
        return None  # a complex result (float() of it is a TypeError)
