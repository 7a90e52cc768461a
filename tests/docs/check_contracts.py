#!/usr/bin/env python3
"""Checks that the headers' contract tags agree with the declarations they describe.

Every public member's doc comment ends with `Contract: <who>; <blocking>; <allocation>;
<throws>.` (README.md, "Contracts"); a class may say `Contract of every member: ...` once,
and its public member functions without a Contract line of their own take it. This script
reads every header under feeds/, devices/ and runtime/ (`*/bspflow/**/*.hpp`, internal
folders too when they carry tags), pairs each tag with the declaration that follows it, and
reports, one line each as `path:line: what disagrees`:

  - a tag saying `noexcept` on a function not declared `noexcept` (or `noexcept(...)`);
    destructors are exempt (they are implicitly noexcept);
  - a tag saying `throws ...` on a function declared plain `noexcept`;
  - a tag saying `non-blocking` on a function whose doc comment says it takes a lock or a
    mutex (a "short" lock is what the vocabulary allows), or whose inline body in the
    header takes one (std::lock_guard, std::unique_lock, std::scoped_lock);
  - a tag that is not four `;`-separated parts in the vocabulary's words.

`allocates; noexcept` is accepted only on a function declared noexcept (or a destructor):
the vocabulary's `noexcept` means "never throws", which such a function keeps (an allocation
failure ends the process instead); anywhere else the allocation's std::bad_alloc would leave
it, and the first rule reports it.

The parser is deliberately small: it blanks comments and literals, splits class and
namespace bodies into declarations at top-level `;` and `{`, and skips function bodies. When
unsure what a declaration is, it checks nothing (a missed check beats a false alarm).

  check_contracts.py [REPO_ROOT] [--verbose]

REPO_ROOT defaults to the checkout this script is in. Exits 0 with a one-line summary when
every tag agrees, 1 with one line per problem. --verbose also lists, on stderr, the tags it
could not pair with a function (a tag on a class or a type, a using-declaration of a member
it cannot find), which it leaves unchecked.
"""
import pathlib
import re
import sys

HEADER_ROOTS = ("feeds", "devices", "runtime")

OWN_TAG = re.compile(r"\bContract:\s*(.*)")
CLASS_TAG = re.compile(r"\bContract of every member:\s*(.*)")
BLOCKING_WORDS = ("blocks", "non-blocking")
LOCK_WORDS = re.compile(r"\b(?:lock|locks|locked|locking|mutex|mutexes)\b", re.IGNORECASE)
NOT_A_LOCK = re.compile(r"\block[- ]free\b|\bno lock\b|\bwithout (?:a |any )?locks?\b|"
                        r"\bshort (?:internal |spin )?lock\b", re.IGNORECASE)
LOCK_IN_BODY = re.compile(r"\b(?:lock_guard|unique_lock|scoped_lock)\b")
OPERATOR = re.compile(
    r"\boperator\s*(?:\(\s*\)|\[\s*\]|<=>|->\*?|<<=|>>=|<<|>>|==|!=|<=|>=|&&|\|\||\+\+|--|"
    r"new\s*(?:\[\s*\])?|delete\s*(?:\[\s*\])?|\"\s*\"\s*\w+|co_await|[-+*/%^&|~!=<>,]=?)")
ACCESS = re.compile(r"(public|private|protected)\s*:(?!:)")


# ---- text preparation ----------------------------------------------------------------------

def blank(text):
    """The text with comments, string and character literals and preprocessor lines replaced
    by spaces (newlines kept, so offsets keep their line numbers)."""
    out = list(text)
    n, i = len(text), 0
    at_line_start = True

    def wipe(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if c == "\n":
            at_line_start = True
            i += 1
            continue
        if c in " \t\r":
            i += 1
            continue
        if at_line_start and c == "#":  # preprocessor line, with continuations
            j = i
            while j < n and not (text[j] == "\n" and text[j - 1] != "\\"):
                j += 1
            wipe(i, j)
            i = j
            continue
        at_line_start = False
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            wipe(i, j)
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            wipe(i, j)
            i = j
        elif c == "R" and text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum()
                                                                        or text[i - 1] == "_")):
            m = re.match(r'R"([^()\\ ]{0,16})\(', text[i:])
            if m is None:
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i + m.end())
            end = n if end < 0 else end + len(m.group(1)) + 2
            wipe(i + 2, end - 1)
            i = end
        elif c == '"' or (c == "'" and not (i > 0 and (text[i - 1].isalnum()
                                                       or text[i - 1] == "_"))):
            # A ' right after a digit or letter is a digit separator (1'000), not a literal.
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            wipe(i + 1, min(j, n))
            i = j + 1
        else:
            i += 1
    return "".join(out)


def doc_lines(lines):
    """{line number: text} for every `///` doc comment line (not the trailing `///<` kind)."""
    docs = {}
    for number, line in enumerate(lines, 1):
        s = line.strip()
        if s.startswith("///") and not s.startswith("///<"):
            docs[number] = s[3:].strip()
    return docs


def doc_block(docs, first_line):
    """(line numbers, texts) of the doc comment block right above `first_line`."""
    numbers = []
    k = first_line - 1
    while k in docs:
        numbers.append(k)
        k -= 1
    numbers.reverse()
    return numbers, [docs[k] for k in numbers]


class Tag:
    """One contract: the doc line it starts on, its words and their four parts."""

    def __init__(self, line, text):
        self.line, self.text = line, text
        body = re.sub(r",\s*unless tagged\s*\.?\s*$", "", text.strip())
        body = body[:-1] if body.endswith(".") else body
        self.parts = [p.strip() for p in body.split(";")]
        self.well_formed = (
            len(self.parts) == 4 and self.parts[0] != "" and self.parts[1] in BLOCKING_WORDS
            and re.match(r"(?:allocates|no-alloc)\b", self.parts[2]) is not None
            and re.match(r"(?:noexcept$|throws\b)", self.parts[3]) is not None)

    @property
    def blocking(self):
        return self.parts[1] if len(self.parts) > 1 else ""

    @property
    def allocates(self):
        return len(self.parts) > 2 and self.parts[2].startswith("allocates")

    @property
    def says_noexcept(self):
        return len(self.parts) > 3 and self.parts[3] == "noexcept"

    @property
    def says_throws(self):
        return len(self.parts) > 3 and self.parts[3].startswith("throws")


def find_tag(block_numbers, block_texts):
    """The block's own Contract line and its class-wide one (either may be None); a tag
    runs on over the next doc lines until its sentence ends with a full stop."""
    own = whole = None
    for idx, text in enumerate(block_texts):
        for pattern, is_class in ((CLASS_TAG, True), (OWN_TAG, False)):
            m = pattern.search(text)
            if m is None:
                continue
            words = m.group(1).strip()
            k = idx
            while not words.endswith(".") and k + 1 < len(block_texts):
                k += 1
                words += " " + block_texts[k].strip()
            tag = Tag(block_numbers[idx], words)
            if is_class:
                whole = whole or tag
            else:
                own = own or tag
            break
    return own, whole


# ---- declarations --------------------------------------------------------------------------

class Decl:
    """One declaration at namespace or class scope, as the parser saw it."""

    def __init__(self, start, head, body, scope):
        self.start, self.head, self.body, self.scope = start, head, body, scope
        self.access = scope.access if scope is not None else "public"


class Scope:
    def __init__(self, kind, access, default, name=""):
        self.kind, self.access, self.default, self.name = kind, access, default, name


def skip_balanced(s, i, open_c="{", close_c="}"):
    """Index just past the bracket matching s[i]."""
    depth = 0
    while i < len(s):
        if s[i] == open_c:
            depth += 1
        elif s[i] == close_c:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i


def top_level(head):
    """(first top-level '(' index, first top-level '=' index) of a normalized head, -1 for
    none; 'top level' means outside (), [] and template <>."""
    paren = angle = 0
    first_paren = first_eq = -1
    for k, c in enumerate(head):
        if c in "([":
            if c == "(" and paren == 0 and angle == 0 and first_paren < 0:
                first_paren = k
            paren += 1
        elif c in ")]":
            paren = max(paren - 1, 0)
        elif paren == 0:
            if c == "<":
                angle += 1
            elif c == ">" and angle > 0 and head[k - 1] != "-":
                angle -= 1
            elif c == "=" and angle == 0 and first_eq < 0 and first_paren < 0:
                nxt = head[k + 1] if k + 1 < len(head) else ""
                prev = head[k - 1] if k > 0 else ""
                if nxt != "=" and prev not in "=!<>":
                    first_eq = k
    return first_paren, first_eq


def normalize(head):
    return OPERATOR.sub("operator@", " ".join(head.split()))


def strip_prefix(head):
    """The head without leading template <...>, attributes and alignas(...)."""
    h = head.strip()
    while True:
        m = re.match(r"template\s*<", h)
        if m:
            h = h[skip_balanced(h, m.end() - 1, "<", ">"):].strip()
            continue
        if h.startswith("[["):
            end = h.find("]]")
            h = h[end + 2:].strip() if end >= 0 else ""
            continue
        m = re.match(r"alignas\s*\(", h)
        if m:
            h = h[skip_balanced(h, m.end() - 1, "(", ")"):].strip()
            continue
        if re.match(r"requires\b", h):
            h = skip_requires(h[len("requires"):])
            continue
        return h


def skip_requires(h):
    """`h` past the requires-clause it starts with: constraints (a name with template
    arguments, or a parenthesized expression) joined by && and ||."""
    while True:
        h = h.lstrip()
        if h.startswith("!"):
            h = h[1:].lstrip()
        if h.startswith("("):
            h = h[skip_balanced(h, 0, "(", ")"):]
        else:
            m = re.match(r"(?:::)?\w+(?:\s*::\s*\w+)*", h)
            if m is None:
                return h
            h = h[m.end():].lstrip()
            if h.startswith("<"):
                h = h[skip_balanced(h, 0, "<", ">"):]
        h = h.lstrip()
        if h.startswith("&&") or h.startswith("||"):
            h = h[2:]
            continue
        return h


def class_head(bare):
    """A head (prefix stripped) opens a class, struct or union body."""
    if re.match(r"(?:class|struct|union)\b", bare) is None:
        return False
    h = re.sub(r"\[\[.*?\]\]", " ", bare)
    m = re.search(r"\balignas\s*\(", h)
    if m:
        h = h[:m.start()] + h[skip_balanced(h, m.end() - 1, "(", ")"):]
    return "(" not in h


def class_name(bare):
    """The name a class head (prefix stripped) declares, or ''."""
    h = re.sub(r"\[\[.*?\]\]", " ", bare)
    h = re.sub(r"\balignas\s*\([^)]*\)*", " ", h)
    m = re.match(r"(?:class|struct|union)\s+(?:[\w:]*::)?(\w+)", h)
    return m.group(1) if m and m.group(1) != "final" else ""


NOT_FUNCTIONS = re.compile(r"(?:typedef|using|static_assert|friend\s+(?:class|struct)|"
                           r"concept|namespace|enum|extern)\b")


def is_function(head):
    """A normalized head declares a function (not a variable, type or alias)."""
    h = strip_prefix(head)
    if not h or NOT_FUNCTIONS.match(h):
        return False
    if class_head(h):
        return False
    paren, eq = top_level(h)
    return paren >= 0 and (eq < 0 or eq > paren)


def initializers_at(tail):
    """Where a constructor's member initializers start in the tail after its parameters
    (a single top-level ':'), or -1."""
    depth = 0
    for k, c in enumerate(tail):
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == ":" and depth == 0 and tail[k + 1:k + 2] != ":" and tail[k - 1:k] != ":":
            return k
    return -1


def raw_signature(head):
    h = strip_prefix(head)
    paren, _ = top_level(h)
    return h[:paren], h[skip_balanced(h, paren, "(", ")"):]


def has_initializers(head):
    return initializers_at(raw_signature(head)[1]) >= 0


def split_signature(head):
    """(name part, tail after the parameter list, member initializers cut off) of a
    normalized function head."""
    name, tail = raw_signature(head)
    k = initializers_at(tail)
    return name, tail if k < 0 else tail[:k]


def noexcept_spec(tail):
    """'plain', 'conditional', 'false' or None: what the tail after the parameters declares."""
    m = re.search(r"\bnoexcept\b\s*(\()?", tail)
    if m is None:
        return None
    if m.group(1) is None:
        return "plain"
    arg = tail[m.end(1):skip_balanced(tail, m.start(1), "(", ")") - 1].strip()
    if arg == "true":
        return "plain"
    if arg == "false":
        return "false"
    return "conditional"


def declarations(s):
    """Every declaration of the blanked header text `s`, with its scope."""
    decls = []
    n = len(s)

    def parse_scope(i, scope):
        while True:
            while i < n and s[i] in " \t\r\n;":
                i += 1
            if i >= n:
                return n
            if s[i] == "}":
                return i + 1
            if scope is not None and scope.kind == "class":
                m = ACCESS.match(s, i)
                if m:
                    scope.access = m.group(1)
                    i = m.end()
                    continue
            i = parse_declaration(i, scope)

    def parse_declaration(start, scope):
        j = start
        depth = 0
        while j < n:
            c = s[j]
            if c in "([":
                depth += 1
            elif c in ")]":
                depth = max(depth - 1, 0)
            elif depth == 0 and c == ";":
                decls.append(Decl(start, s[start:j], None, scope))
                return j + 1
            elif depth == 0 and c == "}":
                decls.append(Decl(start, s[start:j], None, scope))
                return j  # the enclosing scope's end
            elif depth == 0 and c == "{":
                head = normalize(s[start:j])
                bare = strip_prefix(head)
                if re.match(r"(?:inline\s+)?namespace\b|extern\s*\"", bare):
                    return parse_scope(j + 1, Scope("namespace", "public", None))
                if class_head(bare):
                    decl = Decl(start, s[start:j], None, scope)
                    decl.inner = Scope("class", "private" if bare.startswith("class") else
                                       "public", None, class_name(bare))
                    decls.append(decl)
                    j = parse_scope(j + 1, decl.inner)
                    while j < n and s[j] != ";":  # declarators after the body, if any
                        j = skip_balanced(s, j) if s[j] == "{" else j + 1
                    return j + 1
                if is_function(head):
                    if has_initializers(head) and re.search(r"[\w>]\s*$", s[start:j]):
                        j = skip_balanced(s, j)  # a member initializer's braces: a_{x}
                        continue
                    end = skip_balanced(s, j)
                    decls.append(Decl(start, s[start:j], s[j:end], scope))
                    return end
                j = skip_balanced(s, j)  # an initializer, enum body or lambda
                continue
            j += 1
        decls.append(Decl(start, s[start:j], None, scope))
        return n

    parse_scope(0, None)
    return decls


# ---- checking ------------------------------------------------------------------------------

class Header:
    """One header, parsed: its doc comment lines and its declarations."""

    def __init__(self, path, rel):
        self.rel = rel
        text = path.read_text(encoding="utf-8")
        self.tagged = "Contract" in text
        self.docs = doc_lines(text.splitlines())
        s = blank(text)
        self.line_of = []
        line = 1
        for c in s:
            self.line_of.append(line)
            line += c == "\n"
        self.line_of.append(line)
        self.decls = declarations(s)


class Result:
    def __init__(self):
        self.problems = []
        self.own_checked = 0
        self.default_checked = 0
        self.skipped = []


def member_index(parsed):
    """{(class name, function name): [noexcept spec of each overload]} over every header, to
    look up what a `using Base::name;` declaration brings in."""
    index = {}
    for header in parsed:
        for decl in header.decls:
            scope = decl.scope
            if hasattr(decl, "inner") or scope is None or not scope.name:
                continue
            head = normalize(decl.head)
            if not is_function(head):
                continue
            name, tail = split_signature(head)
            words = name.split()
            if words:
                key = (scope.name, words[-1].split("::")[-1])
                index.setdefault(key, []).append(noexcept_spec(tail))
    return index


USING_MEMBER = re.compile(r"using\s+(?:typename\s+)?(?:[\w:]*::)?(\w+)\s*::\s*(\w+|operator@)$")


def check_header(header, index, result):
    rel, docs = header.rel, header.docs
    attached = set()
    for decl in header.decls:
        first = header.line_of[decl.start]
        numbers, texts = doc_block(docs, first)
        own, whole = find_tag(numbers, texts)
        if hasattr(decl, "inner"):
            decl.inner.default = whole
            if whole is not None:
                attached.add(whole.line)
                check_form(whole, rel, result)
            if own is not None:
                attached.add(own.line)
                result.skipped.append(f"{rel}:{own.line}: tag on a class, not checked")
            continue
        if whole is not None:
            attached.add(whole.line)
            result.skipped.append(f"{rel}:{whole.line}: class-wide tag on no class")
        if own is not None:
            attached.add(own.line)
        tag, line, inherited = own, own.line if own else first, False
        scope = decl.scope
        if tag is None:
            # A class's tag covers its public member functions that have none of their own.
            if scope is None or scope.kind != "class" or scope.default is None:
                continue
            if decl.access != "public":
                continue
            tag, inherited = scope.default, True
        head = normalize(decl.head)
        bare = strip_prefix(head)
        using = USING_MEMBER.match(bare)
        if using is not None:
            specs = index.get((using.group(1), using.group(2)))
            if specs is None:
                if not inherited:
                    result.skipped.append(f"{rel}:{line}: tag on a using-declaration of a "
                                          f"member not found in the headers, not checked")
                continue
            count(result, inherited)
            check_specs(specs, tag, f"{using.group(2)}() (line {first}, from {using.group(1)})",
                        rel, line, result, inherited)
            continue
        if not is_function(head):
            if not inherited:
                result.skipped.append(f"{rel}:{line}: tag on no function, not checked")
            continue
        if inherited and (re.match(r"friend\b", bare) or re.search(r"=\s*delete\s*$", bare)):
            continue
        count(result, inherited)
        check_function(decl, head, tag, texts, rel, line, result, inherited, first)

    for k, text in docs.items():
        if (OWN_TAG.search(text) or CLASS_TAG.search(text)) and k not in attached:
            result.skipped.append(f"{rel}:{k}: tag before no declaration the parser found")


def count(result, inherited):
    if inherited:
        result.default_checked += 1
    else:
        result.own_checked += 1


def check_form(tag, rel, result):
    if not tag.well_formed:
        result.problems.append(
            f"{rel}:{tag.line}: contract '{tag.text}' is not '<who>; blocks|non-blocking; "
            f"allocates|no-alloc; noexcept|throws ...' (README.md, Contracts)")


def where_of(tag, inherited):
    return f"the class-wide contract (line {tag.line})" if inherited else "contract"


def check_specs(specs, tag, label, rel, line, result, inherited):
    """The noexcept rules for a name whose overloads (`specs`, from noexcept_spec) one tag
    covers."""
    where = where_of(tag, inherited)
    if not inherited:
        check_form(tag, rel, result)
    if tag.says_noexcept and any(spec not in ("plain", "conditional") for spec in specs):
        extra = " (it allocates: std::bad_alloc would leave it)" if tag.allocates else ""
        result.problems.append(f"{rel}:{line}: {label}: {where} says noexcept, the declaration "
                               f"is not noexcept{extra}")
    if tag.says_throws and specs and all(spec == "plain" for spec in specs):
        result.problems.append(f"{rel}:{line}: {label}: {where} says '{tag.parts[3]}', the "
                               f"declaration is noexcept")


def function_label(decl, name, first):
    """How a report names a function: `name()`, with its line."""
    words = name.split()
    word = words[-1].split("::")[-1] if words else "?"
    if word == "operator@":
        m = OPERATOR.search(" ".join(decl.head.split()))
        word = m.group(0).replace(" ", "") if m else "operator"
    return f"{word}() (line {first})"


def check_function(decl, head, tag, doc_texts, rel, line, result, inherited, first):
    name, tail = split_signature(head)
    label = function_label(decl, name, first)
    if "~" in name:  # a destructor is noexcept without saying so
        if not inherited:
            check_form(tag, rel, result)
    else:
        check_specs([noexcept_spec(tail)], tag, label, rel, line, result, inherited)
    if tag.blocking == "non-blocking":
        comment = " ".join(doc_texts)
        said = LOCK_WORDS.search(NOT_A_LOCK.sub("", comment)) if not inherited else None
        taken = LOCK_IN_BODY.search(decl.body) if decl.body else None
        if said or taken:
            why = "its comment says it takes a lock" if said else "its body takes a lock"
            result.problems.append(f"{rel}:{line}: {label}: {where_of(tag, inherited)} says "
                                   f"non-blocking, {why} (a lock that may wait is 'blocks')")


def headers(root):
    for top in HEADER_ROOTS:
        base = root / top
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.hpp")):
            parts = path.relative_to(root).parts
            if "bspflow" in parts and not any(p.startswith("build") for p in parts):
                yield path


def main(argv):
    verbose = "--verbose" in argv
    args = [a for a in argv if a != "--verbose"]
    if len(args) > 1 or any(a.startswith("-") for a in args):
        print("usage: check_contracts.py [REPO_ROOT] [--verbose]", file=sys.stderr)
        return 2
    root = pathlib.Path(args[0]) if args else pathlib.Path(__file__).resolve().parents[2]
    parsed = [Header(path, path.relative_to(root).as_posix()) for path in headers(root)]
    if not any(h.tagged for h in parsed):
        print(f"contracts: no tagged headers under {root}", file=sys.stderr)
        return 1
    index = member_index(parsed)
    result = Result()
    for header in parsed:
        if header.tagged:
            check_header(header, index, result)
    if verbose:
        for line in result.skipped:
            print("note: " + line, file=sys.stderr)
    for problem in result.problems:
        print(problem)
    if result.problems:
        print(f"contracts: {len(result.problems)} disagreements", file=sys.stderr)
        return 1
    print(f"contracts: {result.own_checked} tags checked (and {result.default_checked} members "
          f"by their class's tag), all agree")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
