"""Hostile structured-output specs: the caps refuse them before any compiler (rein.engine.structured.limits),
and what gets past the caps is compiled in a validator process, where a crash or a stall costs
only that spec (rein.engine.structured.validator). The crash here is real: llguidance's stack overflows
on a chain of 3,500 Lark rules, so if isolation broke, this test process would die."""

from __future__ import annotations

import pytest

from rein.engine.errors import StructuredSpecError
from rein.engine.structured import limits, validator
from rein.engine.structured.spec import check_spec, spec_key


def rule_chain(rules: int) -> str:
    """`start: r0`, `r0: r1`, ..., `rN: "a"`: a grammar bomb (3,500 rules crashed llguidance)."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(rules)) + f'r{rules}: "a"\n'


BOMB = {"type": "grammar", "grammar": rule_chain(3500)}


def ref_chain(refs: int, link: str = "pointer") -> dict:
    """A schema whose `$defs` each name the next through `$ref` (a chain of 2,500 crashed
    llguidance; so did 1,000 defs each holding the next in a property): `link` is how a def names
    the next (a JSON pointer, in a property, an anchor, an `$id`)."""
    def one(i: int) -> dict:
        if i == refs:
            named = {"anchor": {"$anchor": f"a{i}"}, "id": {"$id": f"https://x.test/d{i}"}}.get(link, {})
            return {**named, "type": "string"}
        if link == "pointer":
            return {"$ref": f"#/$defs/d{i + 1}"}
        if link == "property":
            return {"type": "object", "properties": {"p": {"$ref": f"#/$defs/d{i + 1}"}}}
        if link == "anchor":
            return {"$anchor": f"a{i}", "$ref": f"#a{i + 1}"}
        return {"$id": f"https://x.test/d{i}", "$ref": f"d{i + 1}"}

    first = {"anchor": "#a0", "id": "https://x.test/d0"}.get(link, "#/$defs/d0")
    return {"type": "json_schema", "schema": {"$defs": {f"d{i}": one(i) for i in range(refs + 1)}, "$ref": first}}


@pytest.mark.parametrize("spec, words", [
    (BOMB, "3502 rules; rein takes at most 1000"),
    ({"type": "grammar", "grammar": "start: " + "(" * 70 + '"a"' + ")" * 70}, "nests brackets 70 deep"),
    ({"type": "regex", "pattern": "(" * 80 + "a" + ")" * 80}, "nests brackets 80 deep"),
    ({"type": "regex", "pattern": "a{100000}"}, "repeats 100000 times"),
    ({"type": "json_schema", "schema": {"enum": list(range(300))}}, "schema.enum has 300 entries"),
    ({"type": "json_schema", "schema": {"anyOf": [{"type": "string", "pattern": "x{20000}"}]}},
     "schema.anyOf[0].pattern repeats 20000 times"),
    (ref_chain(2500), "2500 $refs in a chain from schema.$defs.d0.$ref); rein takes at most 256"),
    (ref_chain(1000, "property"), "3003 levels deep counting the schemas its $refs lead to (1000 $refs"),
    (ref_chain(1500, "anchor"), "1500 $refs in a chain"),
    (ref_chain(1500, "id"), "1500 $refs in a chain"),
    (ref_chain(300), "303 levels deep counting the schemas its $refs lead to (300 $refs"),
])
def test_caps_refuse_before_any_compiler(spec, words, monkeypatch):
    monkeypatch.setattr(validator, "pool", lambda: pytest.fail("the spec reached a compiler"))
    with pytest.raises(StructuredSpecError) as caught:
        check_spec(spec, "guided_grammar")
    assert caught.value.param == "guided_grammar"
    assert words in caught.value.message and "too large" in caught.value.message


def test_deep_schema_is_refused_without_recursion():
    schema: dict = {"type": "string"}
    for _ in range(5000):   # deeper than Python's recursion limit
        schema = {"type": "array", "items": schema}
    assert "levels deep" in limits.limits_problem({"type": "json_schema", "schema": schema})


def test_schemas_with_refs_fit_the_caps():
    """Named types a few levels deep, a recursive type (a cycle counts once around), a short chain."""
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}
    people = {"$defs": {"address": {"type": "object", "properties": {"city": {"type": "string"}}},
                        "person": {"type": "object", "properties": {"home": {"$ref": "#/$defs/address"},
                                                                    "work": {"$ref": "#/$defs/address"}}}},
              "type": "object", "properties": {"people": {"type": "array", "items": {"$ref": "#/$defs/person"}},
                                               "self": {"$ref": "#"}}}
    for schema in (tree, people, ref_chain(80, "property")["schema"], ref_chain(250)["schema"]):
        assert limits.limits_problem({"type": "json_schema", "schema": schema}) is None
    check_spec(ref_chain(80, "property"), "guided_json")   # and llguidance compiles it


def test_real_specs_fit_the_caps():
    grammar = "start: item+\n" + "".join(f'item{i}: "x{i}" ("," item{i})?\n' for i in range(200))
    schema = {"type": "object", "properties": {f"p{i}": {"type": "object", "properties": {
        "a": {"type": "array", "items": {"enum": ["x", "y", "z"]}}, "b": {"type": "string", "pattern": "^[a-z]{1,32}$"}}}
        for i in range(50)}}
    for spec in ({"type": "grammar", "grammar": grammar}, {"type": "json_schema", "schema": schema},
                 {"type": "regex", "pattern": r"\(\d{3}\) \d{3}-\d{4}"}):
        assert limits.limits_problem(spec) is None


def test_a_crash_in_the_compiler_costs_only_that_spec():
    pool = validator.ValidatorPool(size=1, timeout=30)
    problem = pool.problem(spec_key(BOMB))      # past the caps: straight to a validator process
    assert problem is not None and "crashed rein's grammar compiler" in problem
    assert pool.problem(spec_key({"type": "grammar", "grammar": 'start: "a" | "b"'})) is None
    assert "unclosed character class" in pool.problem(spec_key({"type": "regex", "pattern": "[a-"}))


def test_a_compile_past_the_deadline_is_refused_and_not_remembered(monkeypatch):
    from rein.engine.structured import spec

    slow = validator.ValidatorPool(size=1, timeout=0.001)   # less than a process takes to start
    with pytest.raises(validator.CompileTimeout, match="took longer than 0.001 s"):
        slow.problem(spec_key({"type": "regex", "pattern": "a+"}))
    monkeypatch.setattr(validator, "pool", lambda: slow)
    key = spec_key({"type": "regex", "pattern": "c+d"})
    assert "took longer" in spec.spec_problem(key)
    monkeypatch.setattr(validator, "pool", lambda: validator.ValidatorPool(size=1, timeout=30))
    assert spec.spec_problem(key) is None        # asked again, not answered from the memo


def test_no_validator_process_is_unavailable_not_invalid(monkeypatch):
    def cannot_start():
        raise OSError("no more processes")

    monkeypatch.setattr(validator, "_Child", cannot_start)
    with pytest.raises(validator.ValidatorUnavailable, match="no more processes"):
        validator.ValidatorPool(size=1, timeout=5).problem(spec_key({"type": "regex", "pattern": "b+"}))


def test_llguidance_gets_rein_parser_limits(monkeypatch):
    """The validator runs llguidance under PARSER_LIMITS: shrunk here, a plain schema no longer
    fits them (the worker's compile: tests/unit/test_structured_engine.py)."""
    from rein.engine.structured.spec import find_problem

    spec = {"type": "json_schema", "schema": {"type": "object", "properties": {
        f"field_{i}": {"type": "string"} for i in range(20)}}}
    assert find_problem(spec) is None
    monkeypatch.setitem(limits.PARSER_LIMITS, "max_grammar_size", 10)
    problem = find_problem(spec)
    assert problem and "grammar" in problem.lower(), problem


def test_a_module_planted_in_the_working_directory_is_not_imported(tmp_path, monkeypatch):
    """`python -m` puts the working directory first on sys.path: the validator process starts
    with -P, so a json.py there is not imported in place of the standard library's."""
    marker = tmp_path / "planted-module-ran"
    (tmp_path / "json.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise SystemExit('planted')\n")
    monkeypatch.chdir(tmp_path)
    pool = validator.ValidatorPool(size=1, timeout=30)
    assert pool.problem(spec_key({"type": "regex", "pattern": "planted|not"})) is None
    assert "unclosed" in pool.problem(spec_key({"type": "regex", "pattern": "(planted"}))
    assert not marker.exists()
