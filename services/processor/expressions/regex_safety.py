"""Could a Java regular expression backtrack catastrophically? A static check, in plain Python.

Spark's regex functions (``rlike``, ``regexp_replace``, ``split``, ...) run ``java.util.regex``, a
backtracking engine: ``^(.*a){10}$`` takes time exponential in the value's length and holds a task
slot for as long as it runs (cancelling the query does not interrupt it). So a job expression may only
use a pattern :func:`regex_problem` accepts (:func:`like_problem` for SQL LIKE, whose ``%`` runs as
``.*``). What passes costs at most a low power of the value's length; on very long values even that
shows (an unanchored ``a*b`` is quadratic), and no check of the pattern alone can remove it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_PATTERN_LENGTH = 512
MAX_OPEN_QUANTIFIERS = 3
OPEN_RANGE = 16
MAX_BOUNDED_CHOICES = 1_000
MAX_REPEAT_COUNT = 1_000

_FLAGS = frozenset("idmsuU")  # inline flags accepted; x (comments) and c (canonical equivalence) are not
_CLASS_ESCAPES = frozenset("dDsSwWhHvVRX")  # each matches one of several characters (\R, \X: a few)
_ANCHOR_ESCAPES = frozenset("bBAGZz")
_CONTROL_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f", "a": "\a", "e": "\x1b"}
_HEX = frozenset("0123456789abcdefABCDEF")
_OCTAL = frozenset("01234567")


class _Refused(Exception):
    """The reason, phrased to follow "the pattern is refused: "."""


def _syntax(detail: str) -> _Refused:
    return _Refused(f"unsupported or invalid syntax ({detail})")


@dataclass
class _Node:
    start: int
    end: int


@dataclass
class _Char(_Node):
    """One character: ``char`` when it is a known literal; None for a class, ``.``, ``\\d``..."""

    char: str | None = None


@dataclass
class _Empty(_Node):
    """Matches no character: an anchor, a boundary, a flag group."""


@dataclass
class _Seq(_Node):
    items: list[_Node] = field(default_factory=list)


@dataclass
class _Alt(_Node):
    branches: list[_Seq] = field(default_factory=list)


@dataclass
class _Group(_Node):
    body: _Node | None = None


@dataclass
class _Repeat(_Node):
    body: _Node | None = None
    min: int = 0
    max: int | None = None  # None: no upper bound

    @property
    def variable(self) -> bool:
        return self.max != self.min

    @property
    def repeats(self) -> bool:
        return self.max is None or self.max > 1

    @property
    def open(self) -> bool:
        return self.max is None or self.max - self.min > OPEN_RANGE


def _children(node: _Node) -> list[_Node]:
    if isinstance(node, _Seq):
        return list(node.items)
    if isinstance(node, _Alt):
        return list(node.branches)
    if isinstance(node, (_Group, _Repeat)) and node.body is not None:
        return [node.body]
    return []


def _descendants(node: _Node) -> list[_Node]:
    out, todo = [], _children(node)
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(_children(current))
    return out


class _Parser:
    """``java.util.regex`` syntax, as far as it decides structure: groups, quantifiers, alternation."""

    def __init__(self, pattern: str) -> None:
        self.p = pattern
        self.i = 0
        self.groups = 0  # capturing groups, as Java's Matcher.groupCount() counts them
        self.case_insensitive = False

    def peek(self, ahead: int = 0) -> str:
        j = self.i + ahead
        return self.p[j] if j < len(self.p) else ""

    def parse(self) -> _Node:
        node = self.alternation()
        if self.i < len(self.p):  # only an unmatched ')' stops alternation() early
            raise _syntax(f"an unmatched ')' at {self.i}")
        return node

    def alternation(self) -> _Node:
        start = self.i
        branches = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else _Alt(start, self.i, branches)

    def sequence(self) -> _Seq:
        seq = _Seq(self.i, self.i)
        while self.i < len(self.p) and self.peek() not in "|)":
            atoms = self.atom()
            if self.peek() in ("*", "+", "?", "{"):
                if not atoms:
                    raise _syntax(f"a quantifier with nothing to repeat at {self.i}")
                atoms[-1] = self.quantified(atoms[-1])
            seq.items.extend(atoms)
        seq.end = self.i
        return seq

    def quantified(self, node: _Node) -> _Node:
        while True:
            c = self.peek()
            if c == "*":
                self.i += 1
                low, high = 0, None
            elif c == "+":
                self.i += 1
                low, high = 1, None
            elif c == "?":
                self.i += 1
                low, high = 0, 1
            else:
                low, high = self.counted()
            if self.peek() in ("?", "+"):  # lazy or possessive: the same choices in another order
                self.i += 1
            node = _Repeat(node.start, self.i, node, low, high)
            if self.peek() in ("*", "+", "?"):
                raise _syntax(f"a dangling quantifier at {self.i}")
            if self.peek() != "{":  # Java stacks a counted quantifier on another: a{2}{3}, a*{3}
                return node

    def counted(self) -> tuple[int, int | None]:
        j = self.p.find("}", self.i)
        low_text, comma, high_text = (self.p[self.i + 1 : j] if j > 0 else "").partition(",")

        def number(text: str) -> bool:
            return text.isascii() and text.isdigit()

        if j < 0 or not number(low_text) or not (number(high_text) or high_text == ""):
            raise _syntax(f"an invalid repetition at {self.i}")
        low = int(low_text)
        high = low if not comma else (int(high_text) if high_text else None)
        if max(low, high or 0) > MAX_REPEAT_COUNT:
            raise _Refused(f"a repeat count is above {MAX_REPEAT_COUNT}")
        if high is not None and high < low:
            raise _syntax(f"an invalid repetition at {self.i}")
        self.i = j + 1
        return low, high

    def atom(self) -> list[_Node]:
        start, c = self.i, self.peek()
        if c == "(":
            return [self.group()]
        if c == "[":
            self.char_class()
            return [_Char(start, self.i, None)]
        if c in ("*", "+", "?", "{"):
            raise _syntax(f"a quantifier with nothing to repeat at {start}")
        if c == "\\":
            return self.escape()
        self.i += 1
        if c in ("^", "$"):
            return [_Empty(start, self.i)]
        return [_Char(start, self.i, None if c == "." else c)]

    def group(self) -> _Node:
        start = self.i
        self.i += 1
        if self.peek() != "?":
            self.groups += 1
        else:
            self.i += 1
            kind = self.peek()
            if kind in (":", ">", "=", "!"):  # non-capturing, atomic, lookahead
                self.i += 1
            elif kind == "<" and self.peek(1) in ("=", "!"):  # lookbehind
                self.i += 2
            elif kind == "<":  # (?<name>...): a letter, then letters and digits
                j = self.p.find(">", self.i)
                name = self.p[self.i + 1 : j] if j > 0 else ""
                if not (name.isascii() and name.isalnum() and name[0].isalpha()):
                    raise _syntax(f"an invalid group name at {start}")
                self.i = j + 1
                self.groups += 1
            elif self.flags(start):
                return _Empty(start, self.i)
        body = self.alternation()
        if self.peek() != ")":
            raise _syntax(f"an unclosed group at {start}")
        self.i += 1
        return _Group(start, self.i, body)

    def flags(self, start: int) -> bool:
        """``(?i)`` (True: the group ends here) or ``(?i-s:`` (False: a body follows)."""
        on = True
        while self.peek() not in (")", ":"):
            c = self.peek()
            if c == "":
                raise _syntax(f"an unclosed group at {start}")
            if c == "-":
                on = False
            elif c in _FLAGS:
                self.case_insensitive |= on and c == "i"
            else:
                raise _Refused(f"the inline flag {c!r} is not supported")
            self.i += 1
        self.i += 1
        return self.p[self.i - 1] == ")"

    def escape(self) -> list[_Node]:
        """A backslash outside a class: what it matches (``\\Q...\\E`` gives one node per character)."""
        start = self.i
        self.i += 1
        c = self.peek()
        if c == "Q":
            j = self.p.find("\\E", self.i + 1)
            end = len(self.p) if j < 0 else j
            chars: list[_Node] = [_Char(k, k + 1, self.p[k]) for k in range(self.i + 1, end)]
            self.i = end if j < 0 else j + 2
            return chars
        if c == "b" and self.peek(1) == "{":  # \b{g}: a grapheme cluster boundary
            j = self.p.find("}", self.i)
            if j < 0:
                raise _syntax(f"an unclosed \\b{{ at {start}")
            self.i = j + 1
            return [_Empty(start, self.i)]
        if c in _ANCHOR_ESCAPES:
            self.i += 1
            return [_Empty(start, self.i)]
        return [_Char(start, self.i, self.escaped_char())]

    def escaped_char(self) -> str | None:
        """One escape, self.i just after its backslash: the character, or None for a class."""
        at, c = self.i - 1, self.peek()
        if c == "":
            raise _syntax("a trailing backslash")
        self.i += 1
        if c in "123456789" or c == "k":
            raise _Refused(f"it has a backreference at {at}; backreferences are not allowed")
        if c in ("p", "P", "N"):  # \p{Lu}, \pL, \N{name}
            if self.peek() == "{":
                j = self.p.find("}", self.i)
                if j < 0:
                    raise _syntax(f"an unclosed \\{c}{{ at {at}")
                self.i = j + 1
            elif c != "N" and self.peek().isascii() and self.peek().isalpha():
                self.i += 1
            else:
                raise _syntax(f"an invalid \\{c} at {at}")
            return None
        if c in ("x", "u"):
            braced = c == "x" and self.peek() == "{"
            if braced:
                j = self.p.find("}", self.i)
                digits, self.i = (self.p[self.i + 1 : j], j + 1) if j > 0 else ("", self.i)
            else:
                width = 2 if c == "x" else 4
                digits = self.p[self.i : self.i + width]
                self.i += width if len(digits) == width else 0
            if not digits or len(digits) > 6 or not set(digits) <= _HEX or (not braced and len(digits) < 2):
                raise _syntax(f"an invalid \\{c} escape at {at}")
            if c == "u" and len(digits) != 4:
                raise _syntax(f"an invalid \\u escape at {at}")
            return chr(min(int(digits, 16), 0x10FFFF))
        if c == "0":  # \0n, \0nn, \0mnn (m at most 3)
            digits = ""
            while self.peek() and self.peek() in _OCTAL and len(digits) < 3:
                if len(digits) == 2 and digits[0] > "3":
                    break
                digits += self.peek()
                self.i += 1
            if not digits:
                raise _syntax(f"an invalid octal escape at {at}")
            return chr(int(digits, 8))
        if c == "c":
            if not self.peek():
                raise _syntax(f"an invalid \\c escape at {at}")
            self.i += 1
            return chr(ord(self.p[self.i - 1]) ^ 64)
        if c in _CONTROL_ESCAPES:
            return _CONTROL_ESCAPES[c]
        if c in _CLASS_ESCAPES:
            return None
        if c.isascii() and c.isalnum():  # Java refuses the other letters and digits
            raise _syntax(f"the escape \\{c} at {at}")
        return c

    def char_class(self) -> None:
        """Consume ``[...]`` as Java reads it: nested classes, ``&&``, escapes, a first ``]`` literal."""
        start = self.i
        self.i += 1
        if self.peek() == "^":
            self.i += 1
        first = True
        while True:
            c = self.peek()
            if c == "":
                raise _syntax(f"an unclosed character class at {start}")
            if c == "]" and not first:
                self.i += 1
                return
            first = False
            if c == "[":
                self.char_class()
            elif c == "\\" and self.peek(1) == "Q":
                j = self.p.find("\\E", self.i + 2)
                if j < 0:
                    raise _syntax(f"an unclosed character class at {start}")
                self.i = j + 2
            elif c == "\\":
                self.i += 1
                self.escaped_char()  # a letter Java refuses in a class (\b, \E, ...) is refused here too
            else:
                self.i += 1


def _first_char(branch: _Seq) -> str | None:
    first = branch.items[0] if branch.items else None
    return first.char if isinstance(first, _Char) else None


def _parse(pattern: str) -> tuple[_Node, _Parser]:
    parser = _Parser(pattern)
    return parser.parse(), parser


def regex_problem(pattern: str) -> str | None:
    """Why ``pattern`` is refused (it could backtrack catastrophically, or is not understood), or None.

    The pattern is parsed with Java's syntax (what the parser does not understand it refuses, it never
    guesses). Refused:

    - a pattern longer than :data:`MAX_PATTERN_LENGTH` characters;
    - backreferences (``\\1``, ``\\k<name>``);
    - a repeated part that contains a quantifier of variable count: ``(a+)+``, ``(.*a){10}``,
      ``(a?){20}``, the classic exponential case (a fixed count inside, as in ``(ab{2})+``, is fine);
    - alternatives inside a repeated part unless each starts with a different literal character
      (``(GET|PUT)+`` is fine; ``(a|a)*``, ``(a|ab)*`` and ``(\\d|x)+`` are not);
    - more than :data:`MAX_OPEN_QUANTIFIERS` open quantifiers (``*``, ``+``, ``{n,}``, or a range wider
      than :data:`OPEN_RANGE`): backtracking over k of them costs up to the value's length to the power
      k, so ``.*a.*a.*a.*a`` is refused although nothing in it is nested;
    - optional and ranged parts whose choices multiply past :data:`MAX_BOUNDED_CHOICES` (``a?`` ten
      times is 1024 ways);
    - counts above :data:`MAX_REPEAT_COUNT`, the comments flag ``(?x)`` (it changes how the pattern
      parses) and canonical equivalence ``(?c)``.
    """
    if len(pattern) > MAX_PATTERN_LENGTH:
        return f"it is longer than {MAX_PATTERN_LENGTH} characters"
    try:
        tree, parser = _parse(pattern)
    except _Refused as e:
        return str(e)
    repeats = [n for n in [tree, *_descendants(tree)] if isinstance(n, _Repeat)]
    for outer in (r for r in repeats if r.repeats):
        shown = pattern[outer.start : outer.end]
        inside = _descendants(outer)
        nested = [d for d in inside if isinstance(d, _Repeat) and d.variable]
        if nested:
            quantifier = pattern[nested[0].start : nested[0].end]
            return f"the repeated part {shown!r} contains the quantifier {quantifier!r} (nested quantifiers)"
        for alt in (d for d in inside if isinstance(d, _Alt)):
            firsts = [_first_char(b) for b in alt.branches]
            if parser.case_insensitive:
                firsts = [f.casefold() if f is not None else None for f in firsts]
            if None in firsts or len(set(firsts)) != len(firsts):
                return (
                    f"the repeated part {shown!r} has alternatives that do not each start with a different "
                    "literal character"
                )
    open_count = sum(1 for r in repeats if r.open)
    if open_count > MAX_OPEN_QUANTIFIERS:
        return (
            f"it has {open_count} open quantifiers (*, +, {{n,}}, wide ranges), more than "
            f"{MAX_OPEN_QUANTIFIERS}"
        )
    choices = 1
    for r in repeats:
        if r.variable and not r.open and r.max is not None:
            choices *= r.max - r.min + 1
    if choices > MAX_BOUNDED_CHOICES:
        return f"its optional and ranged parts combine in {choices} ways, more than {MAX_BOUNDED_CHOICES}"
    return None


def capturing_groups(pattern: str) -> int | None:
    """The capturing groups the parser counts (None if it refuses the syntax): tests compare with Java."""
    try:
        return _parse(pattern)[1].groups
    except _Refused:
        return None


def like_problem(pattern: str, escape: str = "\\") -> str | None:
    """Why a LIKE pattern is refused, or None: the same limits, each unescaped ``%`` an open quantifier."""
    if len(pattern) > MAX_PATTERN_LENGTH:
        return f"it is longer than {MAX_PATTERN_LENGTH} characters"
    wildcards, i = 0, 0
    while i < len(pattern):
        if pattern[i] == escape:
            i += 2
            continue
        wildcards += pattern[i] == "%"
        i += 1
    if wildcards > MAX_OPEN_QUANTIFIERS:
        return f"it has {wildcards} '%' wildcards, more than {MAX_OPEN_QUANTIFIERS}"
    return None
