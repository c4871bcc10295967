"""User expressions (derive, filter, having) checked with Spark's own parser and analyser.

An expression is parsed by the session's SQL parser (``sessionState.sqlParser.parseExpression``), so
only an *expression* gets through: a statement, a subquery or a second clause is refused there or by
the tree walk below. It is then analysed against the columns it will see, on an empty local
DataFrame with the same schema, which names the unknown columns or functions and the type errors.
Nothing the user wrote is evaluated by Python, and no function can be registered: only Spark's
built-in functions exist in this session.
"""

from __future__ import annotations

from typing import Any, Literal

from pyspark.errors import AnalysisException, ParseException
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from shared.errors import SpecError

Role = Literal["derive", "filter", "having"]

# Built-ins that reach outside the data (reflect calls any static Java method), fail the query on
# purpose (raise_error, assert_true: bad input must never stop a job), or read the clock (a replayed
# batch would then compute different rows under the same version).
FORBIDDEN_FUNCTIONS = frozenset(
    {
        "reflect",
        "java_method",
        "try_reflect",
        "raise_error",
        "assert_true",
        "current_timestamp",
        "current_date",
        "current_time",
        "curdate",
        "now",
        "localtimestamp",
        "current_timezone",
        "session_user",
        "current_user",
        "user",
    }
)
_SUBQUERY_NODES = ("ScalarSubquery", "Exists", "ListQuery", "InSubquery", "LateralSubquery")
# Plan nodes an analysed expression may add on top of its (empty, local) input relation.
_INPUT_NODES = frozenset({"LocalRelation", "LogicalRDD"})
_ALLOWED_NODES: dict[Role, frozenset[str]] = {
    "derive": frozenset({"Project", "Generate"}) | _INPUT_NODES,
    "filter": frozenset({"Filter"}) | _INPUT_NODES,
    "having": frozenset({"Filter"}) | _INPUT_NODES,
}


def _seq(seq: Any) -> list[Any]:
    return [seq.apply(i) for i in range(seq.size())]


def _walk(node: Any) -> list[Any]:
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
    """Parse with Spark's parser and refuse what is not a plain expression over the row."""
    parser = spark._jsparkSession.sessionState().sqlParser()
    try:
        tree = parser.parseExpression(text)
    except Exception as e:  # py4j wraps Spark's ParseException
        raise SpecError(f"{where}: not a Spark SQL expression: {_parse_message(e)}") from None
    for node in _walk(tree):
        name = node.getClass().getSimpleName()
        if name in _SUBQUERY_NODES:
            raise SpecError(f"{where}: subqueries are not allowed in an expression")
        if name == "UnresolvedFunction":
            fn = ".".join(_seq(node.nameParts())).lower()
            if fn in FORBIDDEN_FUNCTIONS:
                raise SpecError(f"{where}: function {fn}() is not allowed in a job expression")
        if name == "UnresolvedAttribute":
            column = ".".join(_seq(node.nameParts()))
            if column.startswith("__"):
                raise SpecError(f"{where}: column {column!r} is internal to the processor")


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
    """``text`` as a Column, after checking it parses, resolves and suits its role over ``row_schema``."""
    parse_checked(spark, text, where)
    empty = spark.createDataFrame([], row_schema)
    column = F.expr(text)
    try:
        probe = empty.select("*", column.alias("__probe")) if role == "derive" else empty.where(column)
    except AnalysisException as e:
        raise SpecError(f"{where}: {_first_line(e)}") from None
    for node in _analysed_nodes(probe):
        name = node.getClass().getSimpleName()
        if name not in _ALLOWED_NODES[role]:
            what = {"Aggregate": "an aggregate function", "Window": "a window function"}.get(name, name)
            raise SpecError(f"{where}: {what} is not allowed here; use the spec's aggregations")
        for expr in _seq(node.expressions()):
            if not expr.deterministic():
                raise SpecError(f"{where}: non-deterministic expressions (rand, uuid, ...) are not allowed")
    return column


def analysis_error(e: AnalysisException | ParseException, where: str) -> SpecError:
    return SpecError(f"{where}: {_first_line(e)}")
