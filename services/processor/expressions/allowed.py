"""The Spark expressions a job expression may contain: a reviewed allow-list of Catalyst classes.

``services.processor.expressions.check`` checks the class of every node of an analysed expression
against ``ALLOWED``, whatever name the text used, so a function a Spark upgrade adds is refused until
someone reviews it here. What belongs here: pure functions of the row whose time and memory are
bounded by their input (linear, or n log n for sorting). Not: anything reading the clock, the session
or the outside world, random values, functions that fail on purpose, lambdas, aggregates and window
functions, or results whose size an argument sets without a bound. A builder bounded by a literal goes
in ``BOUNDED_BUILDERS``, a regex or LIKE function in ``PATTERN_ARGUMENT``: check a new class's Catalyst
source for both. tests/security/test_job_expressions.py checks every name against the installed Spark.
"""

from __future__ import annotations

CATALYST = "org.apache.spark.sql.catalyst.expressions."

# Each builder's result size comes from an argument: allowed only when that argument is a literal
# (after constant folding) within these limits. A builder we cannot bound statically (printf's
# widths, array_insert's position) is simply not allowed.
MAX_BUILT_ELEMENTS = 10_000  # sequence(), array_repeat()
MAX_BUILT_STRING_LENGTH = 65_536  # characters: repeat(), space(), lpad(), rpad(), format_number()

# What the analyser itself puts in a tree: columns, literals, implicit casts, field access, and the
# common-subexpression nodes of nullif/between. Cast is checked to be non-ANSI on top.
_STRUCTURE = (
    "Alias",
    "AttributeReference",
    "Literal",
    "TypedNullLiteral",  # Spark 4.2 (nullif's null); gone in 4.3
    "Cast",
    "With",
    "CommonExpressionDef",
    "CommonExpressionRef",
    "GetStructField",
    "GetArrayItem",
    "GetMapValue",
    "GetArrayStructFields",
)
_ARITHMETIC = (
    "Add",
    "Subtract",
    "Multiply",
    "Divide",
    "IntegralDivide",
    "Remainder",
    "Pmod",
    "UnaryMinus",
    "UnaryPositive",
    "Abs",
    "TryAdd",
    "TrySubtract",
    "TryMultiply",
    "TryDivide",
    "TryMod",
    "Greatest",
    "Least",
    "BitwiseAnd",
    "BitwiseOr",
    "BitwiseXor",
    "BitwiseNot",
    "BitwiseCount",
    "BitwiseGet",
    "ShiftLeft",
    "ShiftRight",
    "ShiftRightUnsigned",
)
_LOGIC = (
    "EqualTo",
    "EqualNullSafe",
    "EqualNull",
    "LessThan",
    "LessThanOrEqual",
    "GreaterThan",
    "GreaterThanOrEqual",
    "Not",
    "And",
    "Or",
    "In",
    "InSet",
    "Between",
    "IsNull",
    "IsNotNull",
    "IsNaN",
    "If",
    "CaseWhen",
    "Coalesce",
    "NullIf",
    "Nvl",
    "Nvl2",
    "NaNvl",
    "NullIfZero",
    "ZeroIfNull",
)
# Each result is at most a constant times its inputs (concat: their sum).
_STRINGS = (
    "Upper",
    "Lower",
    "InitCap",
    "Substring",
    "Left",
    "Right",
    "Concat",  # strings and arrays
    "ConcatWs",
    "StringTrim",
    "StringTrimLeft",
    "StringTrimRight",
    "StringTrimBoth",
    "Length",
    "BitLength",
    "OctetLength",
    "StringReplace",
    "StringTranslate",
    "StringInstr",
    "StringLocate",
    "SubstringIndex",
    "SplitPart",  # a literal delimiter, not a regex
    "Contains",
    "StartsWith",
    "EndsWith",
    "Ascii",
    "Chr",
    "Base64",
    "UnBase64",
    "Hex",
    "Unhex",
    "Bin",
    "Conv",
    "Reverse",  # strings and arrays
    "Elt",
    "FindInSet",
    "SoundEx",
    "Overlay",
    "Mask",
    "UrlEncode",
    "TryUrlDecode",
)
_MATH = (
    "Round",
    "BRound",
    "Floor",
    "Ceil",
    "RoundCeil",
    "RoundFloor",
    "Sqrt",
    "Cbrt",
    "Exp",
    "Expm1",
    "Log",
    "Logarithm",
    "Log10",
    "Log2",
    "Log1p",
    "Pow",
    "Signum",
    "Sin",
    "Cos",
    "Tan",
    "Asin",
    "Acos",
    "Atan",
    "Atan2",
    "Sinh",
    "Cosh",
    "Tanh",
    "Asinh",
    "Acosh",
    "Atanh",
    "Cot",
    "Sec",
    "Csc",
    "ToDegrees",
    "ToRadians",
    "Hypot",
    "Pi",
    "EulerNumber",
    "Rint",
    "Factorial",
    "WidthBucket",
)
# Functions of a given time; none reads the clock (unix_timestamp() without an argument does, through a
# CurrentTimestamp child, which is refused).
_DATETIME = (
    "MillisToTimestamp",
    "MicrosToTimestamp",
    "SecondsToTimestamp",
    "UnixMillis",
    "UnixMicros",
    "UnixSeconds",
    "UnixDate",
    "DateFromUnixDate",
    "Year",
    "Quarter",
    "Month",
    "DayOfMonth",
    "DayOfWeek",
    "DayOfYear",
    "WeekDay",
    "WeekOfYear",
    "Hour",
    "Minute",
    "Second",
    "DayName",
    "MonthName",
    "Extract",
    "DateFormatClass",
    "TruncTimestamp",
    "TruncDate",
    "DateAdd",
    "DateSub",
    "DateDiff",
    "AddMonths",
    "MonthsBetween",
    "LastDay",
    "NextDay",
    "MakeDate",
    "MakeTimestamp",
    "MakeDTInterval",
    "MakeYMInterval",
    "FromUnixTime",
    "ToUnixTimestamp",
    "UnixTimestamp",
    "ParseToDate",
    "ParseToTimestamp",
    "GetTimestamp",
    "FromUTCTimestamp",
    "ToUTCTimestamp",
    "ConvertTimezone",
    "TimestampAdd",
    "TimestampDiff",
    "TimestampAddInterval",
    "DatetimeSub",
    "SubtractTimestamps",
    "SubtractDates",
    "DateAddInterval",
    "TimestampAddYMInterval",
    "DateAddYMInterval",
)
# Each result is bounded by its inputs' elements; explode is flat_map (one row per element).
_COLLECTIONS = (
    "CreateArray",
    "CreateNamedStruct",
    "CreateMap",
    "Size",
    "ArraySize",
    "ElementAt",
    "TryElementAt",
    "Get",
    "ArrayContains",
    "ArrayPosition",
    "ArrayDistinct",
    "ArrayMin",
    "ArrayMax",
    "ArrayRemove",
    "ArrayAppend",
    "ArrayPrepend",
    "ArrayUnion",
    "ArrayIntersect",
    "ArrayExcept",
    "ArraysOverlap",
    "ArrayJoin",
    "SortArray",
    "Slice",
    "Flatten",
    "ArraysZip",
    "MapKeys",
    "MapValues",
    "MapContainsKey",
    "MapEntries",
    "Explode",
    "PosExplode",
)
_JSON_AND_HASHES = (
    "GetJsonObject",  # a streaming parse of one string; path syntax errors give NULL
    "LengthOfJsonArray",
    "JsonObjectKeys",
    "Md5",
    "Sha1",
    "Sha2",
    "Crc32",
    "Murmur3Hash",
    "XxHash64",
)

# Builders whose result size comes from an argument; services.processor.expressions has a check for
# each (repeat, space, lpad, rpad, sequence, array_repeat, format_number).
_BUILDERS = (
    "StringRepeat",
    "StringSpace",
    "StringLPad",
    "StringRPad",
    "Sequence",
    "ArrayRepeat",
    "FormatNumber",
)
BOUNDED_BUILDERS = frozenset(CATALYST + n for n in _BUILDERS)
# class -> the index of its pattern among its children. Like and ILike take a LIKE pattern.
PATTERN_ARGUMENT = {
    CATALYST + "RLike": 1,  # rlike, regexp, regexp_like
    CATALYST + "RegExpReplace": 1,
    CATALYST + "RegExpExtract": 1,
    CATALYST + "RegExpExtractAll": 1,
    CATALYST + "RegExpCount": 1,
    CATALYST + "RegExpSubStr": 1,
    CATALYST + "RegExpInStr": 1,
    CATALYST + "StringSplit": 1,  # split(): its delimiter is a regex
    CATALYST + "Like": 1,
    CATALYST + "ILike": 1,
}
LIKE_CLASSES = frozenset({CATALYST + "Like", CATALYST + "ILike"})

_PLAIN = (*_STRUCTURE, *_ARITHMETIC, *_LOGIC, *_STRINGS, *_MATH, *_DATETIME, *_COLLECTIONS, *_JSON_AND_HASHES)
ALLOWED = frozenset(CATALYST + n for n in _PLAIN) | BOUNDED_BUILDERS | frozenset(PATTERN_ARGUMENT)

# Why some well-known classes are refused, for a message that says more than "not allowed".
_OUTSIDE = "it reaches outside the event's data"
_CLOCK = "it reads the clock or the session; a replayed batch must compute the same rows"
REFUSAL_REASONS = {
    **{
        CATALYST + n: _OUTSIDE
        for n in (
            "CallMethodViaReflection",
            "TryReflect",
            "InputFileName",
            "InputFileBlockStart",
            "InputFileBlockLength",
            "ScalaUDF",
            "PythonUDF",
            "SparkVersion",
            "SparkPartitionID",
            "FromProtobuf",
            "ToProtobuf",
            "FromAvro",
            "ToAvro",
        )
    },
    **{
        CATALYST + n: _CLOCK
        for n in (
            "CurrentTimestamp",
            "CurrentDate",
            "CurDateExpressionBuilder",
            "CurrentTime",
            "Now",
            "LocalTimestamp",
            "CurrentTimeZone",
            "CurrentUser",
            "CurrentDatabase",
            "CurrentCatalog",
        )
    },
    **{
        CATALYST + n: "it is non-deterministic; a replayed batch must compute the same rows"
        for n in ("Rand", "Randn", "Uuid", "Shuffle", "RandStr", "Uniform", "MonotonicallyIncreasingID")
    },
    **{
        CATALYST + n: "it fails the job on purpose; bad input must never stop a job"
        for n in ("RaiseError", "RaiseErrorExpressionBuilder", "AssertTrue")
    },
    CATALYST + "FormatString": "its format can build a string of any width",
    CATALYST + "ArrayInsert": "it pads the array up to any position its argument names",
    CATALYST + "Levenshtein": "its time grows with the product of the two strings' lengths",
    CATALYST + "ArraySort": "it runs a comparator lambda; sort_array() sorts without one",
    **{
        CATALYST + n: "higher-order functions (lambdas) are not allowed"
        for n in (
            "ArrayTransform",
            "ArrayFilter",
            "ArrayAggregate",
            "ArrayExists",
            "ArrayForAll",
            "ArrayCompact",
            "ZipWith",
            "MapFilter",
            "TransformKeys",
            "TransformValues",
            "MapZipWith",
            "LambdaFunction",
        )
    },
}
