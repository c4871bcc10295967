"""User expressions (derive, filter, having) checked with Spark's own parser and analyser, then
against an allow-list of what the analysed expression may contain (``checked_column``).

Nothing the user wrote is evaluated by Python, no function can be registered (only Spark's built-in
functions exist in this session), and the only parts Spark evaluates while checking are literal
arguments that have passed the check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from py4j.protocol import Py4JJavaError
from pyspark.errors import AnalysisException, ParseException
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from services.processor.expressions.allowed import (
    ALLOWED,
    BOUNDED_BUILDERS,
    CATALYST,
    LIKE_CLASSES,
    MAX_BUILT_ELEMENTS,
    MAX_BUILT_STRING_LENGTH,
    PATTERN_ARGUMENT,
    REFUSAL_REASONS,
)
from services.processor.expressions.regex_safety import like_problem, regex_problem
from shared.errors import SpecError

Role = Literal["derive", "filter", "having"]

_SUBQUERY_NODES = ("ScalarSubquery", "Exists", "ListQuery", "InSubquery", "LateralSubquery")
# `*` would expand to the processor's internal columns at run time (the probe below does not have them).
_STAR_NODES = ("UnresolvedStar", "UnresolvedRegex")
# Parsed nodes that read the row (a lambda's variable counts: lambdas are refused later, by name).
_COLUMN_NODES = frozenset({"UnresolvedAttribute", "UnresolvedNamedLambdaVariable"})
_CONSTANT_ALLOWED = ALLOWED - BOUNDED_BUILDERS - frozenset(PATTERN_ARGUMENT)
# Plan nodes an analysed expression may add on top of its (empty, local) input relation.
_INPUT_NODES = frozenset({"LocalRelation", "LogicalRDD"})
_ALLOWED_NODES: dict[Role, frozenset[str]] = {
    "derive": frozenset({"Project", "Generate"}) | _INPUT_NODES,
    "filter": frozenset({"Filter"}) | _INPUT_NODES,
    "having": frozenset({"Filter"}) | _INPUT_NODES,
}
_CAST = CATALYST + "Cast"
_REGEXP_REPLACE = CATALYST + "RegExpReplace"
_INTEGRAL_TYPES = ("byte", "short", "integer", "long")
_FIXED_WIDTH_TYPES = (*_INTEGRAL_TYPES, "float", "double", "boolean", "date", "timestamp", "void")


def _seq(seq: Any) -> list[Any]:
    return [seq.apply(i) for i in range(seq.size())]


def _walk(node: Any) -> list[Any]:
    """``node`` and everything under it, each node before its descendants."""
    out, todo = [], [node]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(_seq(current.children()))
    return out


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def parse_checked(spark: SparkSession, text: str, where: str) -> None:
    """Parse with Spark's parser and refuse what is not a plain expression over the row's fields."""
    parser = spark._jsparkSession.sessionState().sqlParser()
    try:
        tree = parser.parseExpression(text)
    except Exception as e:  # py4j wraps Spark's ParseException
        raise SpecError(f"{where}: not a Spark SQL expression: {_parse_message(e)}") from None
    for node in _walk(tree):
        name = node.getClass().getSimpleName()
        if name in _SUBQUERY_NODES:
            raise SpecError(f"{where}: subqueries are not allowed in an expression")
        if name in _STAR_NODES:
            raise SpecError(f"{where}: `*` is not allowed in an expression; name the fields")
        if name == "UnresolvedAttribute":
            column = ".".join(_seq(node.nameParts()))
            if column.startswith("__"):
                raise SpecError(f"{where}: column {column!r} is internal to the processor")
    _check_constants(spark, tree, text, where, root=True)


def _check_constants(spark: SparkSession, node: Any, text: str, where: str, *, root: bool) -> bool:
    """Whether ``node`` reads a column; refuses a costly part computed from constants alone.

    Spark's analyser evaluates some constant arguments while it checks types (a regexp_extract group
    index, a mask character, a from_json schema): on the driver, before the allow-list below has seen
    anything. So every constant part of an expression, except the whole expression (which analysis
    does not evaluate), may only be made of allowed functions that are neither builders nor patterns.
    """
    reads = node.getClass().getSimpleName() in _COLUMN_NODES
    for child in _seq(node.children()):
        reads = _check_constants(spark, child, text, where, root=False) or reads
    if not reads and not root:
        cls, name = _parsed_class(spark, node)
        if cls in REFUSAL_REASONS:
            raise SpecError(
                f"{where}: function {name}() is not allowed in a job expression ({REFUSAL_REASONS[cls]})"
            )
        if cls not in _CONSTANT_ALLOWED:
            raise SpecError(
                f"{where}: {_source(node, text)} is computed from constants alone; such a part may only use "
                "literals, casts, arithmetic and simple functions (write its value instead)"
            )
    return reads


def _parsed_class(spark: SparkSession, node: Any) -> tuple[str, str]:
    """A parsed node's Catalyst class (a function call's from the built-in registry) and its name."""
    cls = str(node.getClass().getName())
    if node.getClass().getSimpleName() != "UnresolvedFunction":
        return cls, str(node.prettyName())
    parts = [str(p) for p in _seq(node.nameParts())]
    name = ".".join(parts)
    if [p.lower() for p in parts[:-1]] not in ([], ["builtin"], ["system", "builtin"]):
        return "", name  # not a built-in function: refused
    jvm = spark._jvm
    assert jvm is not None  # a classic (not Connect) session, as the processor builds
    identifier = jvm.org.apache.spark.sql.catalyst.FunctionIdentifier.apply(
        parts[-1], jvm.scala.Some.apply("builtin"), jvm.scala.Some.apply("system")
    )
    info = spark._jsparkSession.sessionState().functionRegistry().lookupFunction(identifier)
    return (str(info.get().getClassName()) if info.isDefined() else ""), name


def _source(node: Any, text: str) -> str:
    """The part of the user's text a parsed node came from."""
    origin = node.origin()
    if origin.startIndex().isDefined() and origin.stopIndex().isDefined():
        return text[origin.startIndex().get() : origin.stopIndex().get() + 1]
    return str(node.sql())


def _parse_message(e: Exception) -> str:
    text = str(e)
    # Py4J puts the Java exception text after its own header line.
    for marker in ("ParseException:", "[PARSE_SYNTAX_ERROR]", "[PARSE"):
        at = text.find(marker)
        if at >= 0:
            return " ".join(text[at:].split())[:500]
    return _first_line(e)[:500]


def _analysed_nodes(df: DataFrame) -> list[Any]:
    return _walk(df._jdf.queryExecution().analyzed())


def checked_column(
    spark: SparkSession, text: str, row_schema: T.StructType, role: Role, where: str
) -> Column:
    """``text`` as a Column, after checking it parses, resolves, suits its role over ``row_schema`` and
    contains only allowed expressions:

    1. The session's SQL parser (``sessionState.sqlParser.parseExpression``) lets only an *expression*
       through; subqueries, ``*`` and columns starting with ``__`` are refused in its tree.
    2. The expression is analysed against the columns it will see, on an empty local DataFrame with the
       same schema: that names unknown columns or functions and type errors, and the plan may only gain
       a projection or generator (derive) or a filter (filter, having).
    3. Every node of the analysed expression must be of a Catalyst class in
       ``services.processor.expressions.allowed.ALLOWED``, whatever name the text used for it (aliases,
       ``system.builtin.f``, ``IDENTIFIER('f')`` all resolve to the same class). Nodes are checked
       outermost first, so a refusal names the function the user wrote. Casts must not be ANSI.
    4. Builders (``repeat``, ``sequence``, ...) need literal size arguments within the limits, and regex
       and LIKE functions a literal pattern ``services.processor.expressions.regex_safety`` accepts. These
       are checked innermost first: a literal argument is evaluated (constant folding on the driver) only
       after everything inside it has passed.
    """
    parse_checked(spark, text, where)
    empty = spark.createDataFrame([], row_schema)
    column = F.expr(text)
    try:
        probe = empty.select("*", column.alias("__probe")) if role == "derive" else empty.where(column)
    except AnalysisException as e:
        raise SpecError(f"{where}: {_first_line(e)}") from None
    plan = _analysed_nodes(probe)
    for node in plan:
        name = node.getClass().getSimpleName()
        if name not in _ALLOWED_NODES[role]:
            what = {"Aggregate": "an aggregate function", "Window": "a window function"}.get(name, name)
            raise SpecError(f"{where}: {what} is not allowed here; use the spec's aggregations")
    for node in plan:
        for expression in _seq(node.expressions()):
            check_expression(spark, expression, where)
    return column


def check_expression(spark: SparkSession, root: Any, where: str) -> None:
    """Refuse an analysed Catalyst expression that is not made only of allowed, bounded parts."""
    nodes = _walk(root)
    for node in nodes:  # outermost first: a refusal names what the user wrote
        cls = node.getClass().getName()
        if cls not in ALLOWED:
            raise _refusal(node, cls, where)
        if cls == _CAST and str(node.evalMode().toString()) == "ANSI":
            raise SpecError(
                f"{where}: {node.sql()} is an ANSI cast, which fails the job on one bad value; "
                "run the processor non-ANSI (spark.sql.ansi.enabled=false) or use try_cast"
            )
    for node in reversed(nodes):  # innermost first: a literal is evaluated only once its parts passed
        cls = node.getClass().getName()
        if cls in BOUNDED_BUILDERS:
            _check_builder(node, cls, where)
        if cls in PATTERN_ARGUMENT:
            _check_pattern(spark, node, cls, where)


def _function_name(node: Any) -> str:
    # The name the user called it by (Spark keeps the alias: regexp, regexp_like, rlike are one class).
    return str(node.prettyName()).lower()


def _refusal(node: Any, cls: str, where: str) -> SpecError:
    reason = REFUSAL_REASONS.get(cls)
    if reason is None and not node.deterministic():
        reason = "it is non-deterministic; a replayed batch must compute the same rows"
    text = f"{where}: function {_function_name(node)}() is not allowed in a job expression"
    return SpecError(f"{text} ({reason})" if reason else text)


# --- builders ---------------------------------------------------------------------------------------
class _NotLiteral(Exception):
    """An argument that must be a literal is not one, or not of a kind a bound can be computed for."""


def _literal(expression: Any) -> Any:
    """A foldable expression's value, folded on the driver; only called on subtrees already checked."""
    if not expression.foldable():
        raise _NotLiteral(f"{expression.sql()} is not a literal")
    value = expression.eval(None)
    if value is None or isinstance(value, (bool, int, float, str, bytes, bytearray)):
        return value
    return str(value.toString())  # UTF8String, Decimal


def _int(expression: Any) -> int | None:
    value = _literal(expression)
    return None if value is None else int(float(value))


def _type(expression: Any) -> str:
    return str(expression.dataType().typeName())


def _repeat(args: list[Any]) -> tuple[int, int]:
    text, times = _literal(args[0]), _int(args[1])
    size = 0 if text is None or times is None else len(str(text)) * max(times, 0)
    return size, MAX_BUILT_STRING_LENGTH


def _length(index: int) -> Callable[[list[Any]], tuple[int, int]]:
    return lambda args: (max(_int(args[index]) or 0, 0), MAX_BUILT_STRING_LENGTH)


def _sequence(args: list[Any]) -> tuple[int, int]:
    for arg in args:
        if _type(arg) not in _INTEGRAL_TYPES:
            raise _NotLiteral(f"{arg.sql()} is not an integer")
    start, stop, *rest = (_int(a) for a in args)
    step = rest[0] if rest else 1 if (stop or 0) >= (start or 0) else -1
    if start is None or stop is None or not step or (stop - start) * step < 0:
        return 0, MAX_BUILT_ELEMENTS  # NULL, or a sequence Spark itself refuses when it runs
    return (stop - start) // step + 1, MAX_BUILT_ELEMENTS


def _array_repeat(args: list[Any]) -> tuple[int, int]:
    count = max(_int(args[1]) or 0, 0)
    if count > MAX_BUILT_ELEMENTS:
        return count, MAX_BUILT_ELEMENTS
    element = args[0]
    if _type(element) in _FIXED_WIDTH_TYPES or _type(element).startswith("decimal"):
        return count, MAX_BUILT_ELEMENTS
    if _type(element) != "string":
        raise _NotLiteral(f"{element.sql()} is neither a number nor a literal string")
    text = _literal(element)
    return count * len(str(text or "")), MAX_BUILT_STRING_LENGTH


def _format_number(args: list[Any]) -> tuple[int, int]:
    value = _literal(args[1])  # a number of decimal places, or a DecimalFormat pattern
    size = len(value) if isinstance(value, str) else max(int(value or 0), 0)
    return size, MAX_BUILT_STRING_LENGTH


_S, _E = MAX_BUILT_STRING_LENGTH, MAX_BUILT_ELEMENTS
# simple class name -> (what it needs, its size and limit from its arguments)
_BUILDERS: dict[str, tuple[str, Callable[[list[Any]], tuple[int, int]]]] = {
    "StringRepeat": (f"a literal string and a literal count, at most {_S} characters in all", _repeat),
    "StringSpace": (f"a literal count of at most {_S}", _length(0)),
    "StringLPad": (f"a literal length of at most {_S}", _length(1)),
    "StringRPad": (f"a literal length of at most {_S}", _length(1)),
    "Sequence": (f"literal integer bounds (and step) giving at most {_E} elements", _sequence),
    "ArrayRepeat": (
        f"a literal count of at most {_E} of a number, boolean, date or timestamp, "
        f"or of a literal string (at most {_S} characters in all)",
        _array_repeat,
    ),
    "FormatNumber": (f"a literal format (at most {_S} decimal places)", _format_number),
}


def _check_builder(node: Any, cls: str, where: str) -> None:
    needs, measure = _BUILDERS[cls.removeprefix(CATALYST)]
    name = _function_name(node)
    try:
        size, limit = measure(_seq(node.children()))
    except _NotLiteral as e:
        raise SpecError(f"{where}: {name}() is only allowed with {needs} ({e})") from None
    if size > limit:
        raise SpecError(f"{where}: {name}() is only allowed with {needs} (this one would make {size})")


# --- patterns ---------------------------------------------------------------------------------------
def _check_pattern(spark: SparkSession, node: Any, cls: str, where: str) -> None:
    name = _function_name(node)
    args = _seq(node.children())
    argument = args[PATTERN_ARGUMENT[cls]]
    try:
        pattern = _literal(argument)
    except _NotLiteral:
        raise SpecError(
            f"{where}: {name}() needs a literal pattern ({argument.sql()} is not one): a pattern that "
            "comes with the data could backtrack for hours"
        ) from None
    if pattern is None:
        return
    pattern = str(pattern)
    if cls in LIKE_CLASSES:
        problem = like_problem(pattern, str(node.escapeChar()))
    else:
        problem = regex_problem(pattern) or _java_regex_problem(spark, pattern)
    if problem is not None:
        raise SpecError(f"{where}: {name}() pattern {pattern!r} is refused: {problem}")
    if cls == _REGEXP_REPLACE:
        try:
            _literal(args[2])
        except _NotLiteral:
            # A replacement from the data could name a group the pattern lacks ("$9") and fail the job.
            raise SpecError(
                f"{where}: {name}() needs a literal replacement ({args[2].sql()} is not one)"
            ) from None


def _java_regex_problem(spark: SparkSession, pattern: str) -> str | None:
    jvm = spark._jvm
    assert jvm is not None  # a classic (not Connect) session, as the processor builds
    try:
        jvm.java.util.regex.Pattern.compile(pattern)
    except Py4JJavaError as e:
        message = str(e.java_exception.getMessage() or "").strip()
        return f"it is not a valid Java regex ({message.splitlines()[0] if message else 'no reason given'})"
    return None


def analysis_error(e: AnalysisException | ParseException, where: str) -> SpecError:
    return SpecError(f"{where}: {_first_line(e)}")
