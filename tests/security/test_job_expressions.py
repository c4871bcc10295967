"""Job expressions against the allow-list, on a real Spark session: whatever the text calls a function
(an alias, a qualified name, IDENTIFIER()), the analysed class decides; costly builders and patterns
need literal, bounded arguments."""

from __future__ import annotations

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import types as T

from services.processor.expressions.allowed import ALLOWED, CATALYST, REFUSAL_REASONS
from services.processor.expressions.check import Role, checked_column
from shared.errors import SpecError
from tests.integration.test_processor import spark  # noqa: F401  (the shared session fixture)

pytestmark = pytest.mark.integration

ROW = T.StructType(
    [
        T.StructField("page", T.StringType()),
        T.StructField("ms", T.LongType()),
        T.StructField("price", T.DoubleType()),
        T.StructField("tags", T.ArrayType(T.StringType())),
        T.StructField("ts", T.TimestampType()),
    ]
)


@pytest.mark.parametrize(
    ("role", "text"),
    [
        ("derive", "upper(page)"),
        ("derive", "CASE WHEN ms > 100 THEN 'slow' ELSE 'fast' END"),
        ("derive", "round(price * 1.2, 2)"),
        ("derive", "coalesce(page, 'none')"),
        ("derive", "regexp_extract(page, '^/(\\\\w+)', 1)"),
        ("derive", "date_trunc('hour', ts)"),
        ("derive", "size(tags)"),
        ("derive", "repeat('-', 10)"),
        ("derive", "try_cast(page AS INT)"),
        ("filter", "page LIKE '/products/%' AND ms BETWEEN 1 AND 500"),
        ("filter", "page rlike '^/(GET|PUT)/[0-9]+$'"),
        ("filter", "array_contains(tags, 'promo')"),
    ],
)
def test_everyday_expressions_pass(spark: SparkSession, role: Role, text: str) -> None:  # noqa: F811
    checked_column(spark, text, ROW, role, "derive.x")
    # and it runs: the checked column evaluates over a row
    row = spark.createDataFrame([("/a/1", 5, 2.0, ["promo"], None)], ROW)
    column = checked_column(spark, text, ROW, role, "derive.x")
    (row.select(column) if role == "derive" else row.where(column)).collect()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("reflect('java.lang.System', 'exit', 1)", "reflect() is not allowed"),
        ("java_method('java.lang.System', 'exit', 1)", "is not allowed"),
        ("system.builtin.reflect('java.lang.System', 'exit', 1)", "is not allowed"),
        ("IDENTIFIER('reflect')('java.lang.System', 'exit', 1)", "is not allowed"),
        ("raise_error('stop')", "fails the job on purpose"),
        ("assert_true(ms > 0)", "fails the job on purpose"),
        ("current_timestamp()", "clock"),
        ("uuid()", "non-deterministic"),
        ("transform(tags, t -> upper(t))", "lambdas"),
        ("repeat(page, 1000000000)", "repeat"),
        ("repeat(page, ms)", "repeat"),
        ("sequence(1, 100000000)", "sequence"),
        ("regexp_replace(page, '(a+)+$', 'x')", "nested quantifiers"),
        ("page rlike concat('(a+)', '+$')", "nested quantifiers"),
        ("regexp_extract(page, page, 1)", "literal"),
        ("printf('%999999999d', ms)", "is not allowed"),
        ("input_file_name()", "outside"),
        # issue 11's bypasses of the old deny-list, and its expressions that killed the JVM or held slots
        ("system.builtin.raise_error('x')", "fails the job on purpose"),
        ("IDENTIFIER('assert_true')(ms > 0)", "fails the job on purpose"),
        ("builtin.current_timestamp()", "clock"),
        ("IDENTIFIER('current_user')()", "clock"),
        ("size(sequence(1, 300000000 + length(page)))", "sequence"),
        ("length(repeat(page, 1000000000))", "repeat"),
        ("page rlike '^(.*a){10}$'", "nested quantifiers"),
    ],
)
def test_hostile_expressions_are_refused_with_the_reason(
    spark: SparkSession,  # noqa: F811
    text: str,
    message: str,
) -> None:
    with pytest.raises(SpecError) as refused:
        checked_column(spark, text, ROW, "derive", "derive.x")
    assert message in str(refused.value), str(refused.value)
    assert str(refused.value).startswith("derive.x:")


def test_every_allowed_and_named_class_exists_in_the_installed_spark(spark: SparkSession) -> None:  # noqa: F811
    """A class renamed by a Spark upgrade would silently stop being allowed (or refused by reason)."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    loader = jvm.java.lang.Thread.currentThread().getContextClassLoader()
    missing = []
    for name in sorted(ALLOWED | set(REFUSAL_REASONS)):
        if name == CATALYST + "TypedNullLiteral":  # Spark 4.2 only (nullif's null), gone in 4.3
            continue
        try:
            jvm.java.lang.Class.forName(name, False, loader)
        except Exception:
            missing.append(name.removeprefix(CATALYST))
    assert not missing, f"not in Spark {spark.version}: {missing}"
