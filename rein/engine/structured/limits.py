"""Caps on what a structured-output spec may hold, checked in Python before any compiler sees it.

llguidance is native code, and some inputs within the size cap break it: a Lark chain of
3,500 rules (`start: r0`, `r0: r1`, ..., 47 KB) overflowed its stack and took the process
down (2,500 passed); so did a JSON schema whose `$defs` chain 2,500 `$ref`s (or 1,000 defs
each holding the next in a property): nesting that no bracket shows, so the depth cap is also
counted through the schemas `$ref`s lead to. A schema of nested `allOf`/`anyOf` compiles for
seconds. The caps here
are far above what real schemas, regexes and grammars hold (an OpenAI function schema: a few
levels, tens of properties; a hand-written grammar: tens of rules), and each refusal names
the cap and what to change. What still gets through is compiled in a child process with a
deadline (rein.engine.structured.validator), so a crash or a stall costs that request alone.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote, urldefrag, urljoin

MAX_SPEC_CHARS = 100_000     # the spec as JSON (a schema, a regex, a grammar, the choices)
MAX_CHOICES = 1024
MAX_GRAMMAR_RULES = 1000     # rule definitions in a Lark or GBNF grammar
MAX_NESTING = 64             # brackets in a grammar or regex; objects and arrays in a schema
MAX_SCHEMA_NODES = 20_000    # every value in a schema, at any depth
MAX_ALTERNATIVES = 256       # branches of one anyOf / oneOf / allOf, values of one enum
MAX_REPEAT = 10_000          # a counted repetition's bound, {n} or {n,m}, in a regex
# Levels of a schema counted through its `$ref`s (a ref to a schema is one level more): far
# more than a real schema's few levels of named types, about a tenth of what crashed llguidance.
MAX_REFERENCE_DEPTH = 256

# llguidance's own budgets (its LLParserLimits), passed wherever rein builds a matcher or
# validates a grammar, so they hold whatever llguidance's defaults become. The per-step ones
# bound the work of one token's mask, which the engine computes inside its step for every
# constrained request: a mask past them puts that request's matcher in error, and the
# request ends (rein.engine.structured.decoding) rather than stalling the batch. At llguidance's
# quoted speeds: ~7 ms of lexer work and ~1 ms of Earley items per mask at most.
PARSER_LIMITS = {
    "max_items_in_row": 2_000,         # branching of one production row
    "initial_lexer_fuel": 1_000_000,   # building the regex ASTs (~20 ms)
    "step_lexer_fuel": 100_000,        # lexer work per mask
    "step_max_items": 20_000,          # Earley items per mask
    "max_lexer_states": 100_000,       # ~1-2 kB each
    "max_grammar_size": 200_000,       # symbols in all productions
}


def parser_limits() -> Any:
    """PARSER_LIMITS as llguidance's LLParserLimits."""
    from llguidance import LLParserLimits

    return LLParserLimits(**PARSER_LIMITS)


# A rule definition at the start of a line: Lark `name:` / `?name:` / `name.2:`, GBNF `name ::=`.
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.-]*[ \t]*(?:::=|:)", re.MULTILINE)
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_ALTERNATIVE_KEYS = ("anyOf", "oneOf", "allOf", "enum", "prefixItems")


def limits_problem(spec: dict[str, Any]) -> str | None:
    """What in the spec passes a cap, naming the cap and what to change; None when it fits."""
    kind = spec.get("type")
    if kind == "grammar" and isinstance(spec.get("grammar"), str):
        return _grammar_problem(spec["grammar"])
    if kind == "regex" and isinstance(spec.get("pattern"), str):
        return _regex_problem(spec["pattern"], "the regex")
    if kind == "choice" and isinstance(spec.get("choices"), list) and len(spec["choices"]) > MAX_CHOICES:
        return f"{len(spec['choices'])} choices; rein takes at most {MAX_CHOICES}"
    if kind == "json_schema":
        return _schema_problem(spec.get("schema"))
    return None


def _grammar_problem(grammar: str) -> str | None:
    rules = len(_RULE.findall(grammar))
    if rules > MAX_GRAMMAR_RULES:
        return (f"the grammar defines {rules} rules; rein takes at most {MAX_GRAMMAR_RULES}: "
                f"merge rules (a chain of single-use rules can be one rule)")
    return _nesting_problem(_without_literals(grammar), "the grammar")


def _regex_problem(pattern: str, what: str) -> str | None:
    for match in _REPEAT.finditer(pattern):
        bound = max(int(n) for n in match.groups() if n)
        if bound > MAX_REPEAT:
            return (f"{what} repeats {bound} times ({match.group(0)}); rein takes counts up to {MAX_REPEAT}: "
                    f"use * or + for long runs")
    return _nesting_problem(re.sub(r"\\.", "", pattern), what)


def _nesting_problem(text: str, what: str) -> str | None:
    depth = deepest = 0
    for char in text:
        if char in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in ")]}":
            depth = max(depth - 1, 0)
    if deepest > MAX_NESTING:
        return f"{what} nests brackets {deepest} deep; rein takes at most {MAX_NESTING}: flatten it"
    return None


def _without_literals(grammar: str) -> str:
    """The grammar with its string and regex literals and comments taken out (brackets inside
    them do not nest)."""
    grammar = re.sub(r'"(?:[^"\\\n]|\\.)*"', '""', grammar)
    grammar = re.sub(r"/(?:[^/\\\n]|\\.)+/", "//", grammar)
    return re.sub(r"(?m)(//|#).*$", "", grammar)


def _schema_problem(schema: Any) -> str | None:
    """Walked without recursion: the depth is what is being checked."""
    nodes = 0
    stack: list[tuple[Any, int, str]] = [(schema, 1, "schema")]
    while stack:
        value, depth, path = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            return f"the schema holds more than {MAX_SCHEMA_NODES} values; make it smaller"
        if depth > MAX_NESTING:
            return f"the schema nests {depth} levels deep at {path}; rein takes at most {MAX_NESTING}"
        if isinstance(value, dict):
            for key, item in value.items():
                if key in _ALTERNATIVE_KEYS and isinstance(item, list) and len(item) > MAX_ALTERNATIVES:
                    return (f"{path}.{key} has {len(item)} entries; rein takes at most {MAX_ALTERNATIVES} "
                            f"in one {key}")
                if key == "pattern" and isinstance(item, str):
                    problem = _regex_problem(item, f"{path}.pattern")
                    if problem:
                        return problem
                stack.append((item, depth + 1, f"{path}.{key}"))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, f"{path}[{i}]") for i, item in enumerate(value))
    return _reference_problem(schema)


# The base URI of a schema without an `$id` (llguidance's own; any absolute URI would do).
_ROOT_URI = "json-schema:///"


def _reference_problem(schema: Any) -> str | None:
    """The deepest chain of subschemas, following each `$ref` to what it names, past
    MAX_REFERENCE_DEPTH. Called once the literal depth and the size fit their caps (so the
    walk is bounded: every container once, every `$ref` one edge). A `$ref` that cannot be
    resolved here is left to the compiler, which refuses it; a cycle (a recursive schema) counts
    once around."""
    if not isinstance(schema, (dict, list)):
        return None
    nodes: dict[int, tuple[Any, str, str]] = {}       # id -> (container, path, base URI)
    resources: dict[str, Any] = {}                      # absolute URI (no fragment) -> schema
    anchors: dict[tuple[str, str], Any] = {}            # (resource URI, anchor) -> schema
    order: list[int] = []
    stack: list[tuple[Any, str, str]] = [(schema, "schema", _ROOT_URI)]
    resources[_ROOT_URI] = schema
    while stack:
        value, path, base = stack.pop()
        if isinstance(value, dict):
            own = value.get("$id")
            if isinstance(own, str):
                uri, fragment = urldefrag(urljoin(base, own))
                if uri:
                    base = uri
                    resources.setdefault(uri, value)
                if fragment:              # draft 7: "$id": "#name" is an anchor
                    anchors.setdefault((base, fragment), value)
            anchor = value.get("$anchor")
            if isinstance(anchor, str):
                anchors.setdefault((base, anchor), value)
            children = [(item, f"{path}.{key}") for key, item in value.items()]
        else:
            children = [(item, f"{path}[{i}]") for i, item in enumerate(value)]
        nodes[id(value)] = (value, path, base)
        order.append(id(value))
        stack.extend((item, where, base) for item, where in reversed(children) if isinstance(item, (dict, list)))

    def target(ref: str, base: str) -> Any:
        uri, fragment = urldefrag(urljoin(base, ref))
        found = resources.get(uri or base)
        if found is None:
            return None
        if not fragment:
            return found
        if not fragment.startswith("/"):
            return anchors.get((uri or base, fragment))
        for token in unquote(fragment).split("/")[1:]:
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(found, dict) and token in found:
                found = found[token]
            elif isinstance(found, list) and token.isdigit() and int(token) < len(found):
                found = found[int(token)]
            else:
                return None
        return found

    edges: dict[int, list[int]] = {}
    refs: set[int] = set()
    for key in order:
        value, _, base = nodes[key]
        items = value.values() if isinstance(value, dict) else value
        edges[key] = [id(item) for item in items if isinstance(item, (dict, list))]
        if isinstance(value, dict) and isinstance(value.get("$ref"), str):
            found = target(value["$ref"], base)
            if isinstance(found, (dict, list)) and id(found) in nodes:
                edges[key].append(id(found))
                refs.add(key)
    # Longest path below every container, depth first without recursion; an edge back to a
    # container still on the stack (a cycle) is not followed.
    below: dict[int, tuple[int, int | None]] = {}      # id -> (levels from here down, next on that path)
    on_stack: set[int] = set()
    for start in order:
        if start in below:
            continue
        walk = [(start, iter(edges[start]))]
        on_stack.add(start)
        while walk:
            key, pending = walk[-1]
            step = next((n for n in pending if n not in below and n not in on_stack), None)
            if step is not None:
                on_stack.add(step)
                walk.append((step, iter(edges[step])))
                continue
            best, best_next = 1, None
            for n in edges[key]:
                if n in below and below[n][0] + 1 > best:
                    best, best_next = below[n][0] + 1, n
            below[key] = (best, best_next)
            on_stack.discard(key)
            walk.pop()
    start = max(order, key=lambda k: below[k][0])
    levels = below[start][0]
    if levels <= MAX_REFERENCE_DEPTH:
        return None
    followed, first, key = 0, None, start
    while key is not None:
        following = below[key][1]
        if key in refs and following is not None and following not in edges[key][:-1]:
            followed += 1
            first = first or nodes[key][1]
        key = following
    return (f"the schema nests {levels} levels deep counting the schemas its $refs lead to ({followed} "
            f"$refs in a chain from {first}.$ref); rein takes at most {MAX_REFERENCE_DEPTH}: "
            f"shorten the chain of definitions")
