"""Structured outputs in the engine (rein.engine.structured + the LLMEngine hook), on a tiny
random-weight model: its free text is garbage, so every constrained output that validates
shows the constraint did the work.

Outputs that end with finish_reason "stop" must parse and validate (jsonschema, re); those
cut by max_tokens ("length") must be prefixes of valid documents: the test completes them
with the grammar as a witness and validates the completed document independently.
"""

from __future__ import annotations

import json
import re
import threading
import uuid

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rein.engine import EngineConfig, EngineRequestError, LLMEngine, SamplingParams
from rein.engine.structured.cache import GrammarCache, GrammarError
from rein.engine.structured.decoding import StructuredDecoding, prepare_grammar

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
             "additionalProperties": False},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"], "additionalProperties": False}
PROMPT = [11, 22, 33, 44]


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="8MiB", max_model_len=512))


def run(engine: LLMEngine, requests: dict[str, SamplingParams], prompt=PROMPT) -> dict[str, dict]:
    for request_id, params in requests.items():
        engine.add_request(request_id, prompt, params)
    results: dict[str, dict] = {}
    while engine.has_unfinished():
        for out in engine.step():
            r = results.setdefault(out.request_id, {"tokens": [], "text": "", "finish": None})
            r["tokens"].extend(out.new_token_ids)
            r["text"] += out.text_delta
            if out.finished:
                r["finish"] = out.finish_reason
    assert set(results) == set(requests)
    return results


# The witness completion: the allowed token whose text comes first in this list, else the
# allowed token of lowest id. Quotes first (inside a string a bracket is just a character),
# then closing brackets, so it finishes quickly.
_PREFERRED = ['"', "}", "]", ",", ":", "0", "1", "true", "null", "a", " "]


def complete(engine: LLMEngine, spec: dict, tokens: list[int], limit: int = 400) -> str:
    """The text of `tokens` completed into a whole document by the grammar (a prefix of a
    valid document has one); fails if the grammar refuses a token of `tokens`."""
    grammar = engine.grammars.new_matcher(spec)
    for t in tokens:
        assert not grammar.accept(t) or t == tokens[-1], f"grammar ended early at token {t}"
    out = list(tokens)
    texts = {}
    for _ in range(limit):
        if grammar.matcher.is_stopped() or grammar.is_complete:
            return engine.tokenizer.decode(out, skip_special_tokens=True)
        mask = torch.empty((1, engine.grammars.words), dtype=torch.int32)
        grammar.matcher.unsafe_compute_mask_ptr(mask.data_ptr(), engine.grammars.words * 4)
        bits = ((mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
        allowed = [t for t in bits.nonzero().flatten().tolist() if t not in engine.eos_token_ids]
        assert allowed, "the grammar allows nothing but it is not complete"
        for t in allowed:
            texts.setdefault(t, engine.tokenizer.decode([t]))
        ranked = sorted(allowed, key=lambda t: (_PREFERRED.index(texts[t]) if texts[t] in _PREFERRED
                                                else len(_PREFERRED), t))
        grammar.accept(ranked[0])
        out.append(ranked[0])
    raise AssertionError(f"no completion within {limit} tokens: {engine.tokenizer.decode(out)!r}")


def check_json(engine, spec, schema, result):
    if result["finish"] == "stop":
        jsonschema.validate(json.loads(result["text"]), schema)
    else:
        assert result["finish"] == "length"
        jsonschema.validate(json.loads(complete(engine, spec, result["tokens"])), schema)


def sampled(spec, seed, max_tokens=80, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, structured=spec, **kw)


# -- each kind ---------------------------------------------------------------------------------


def test_json_schema_outputs_validate(engine):
    spec = {"type": "json_schema", "schema": PERSON}
    results = run(engine, {f"p{i}": sampled(spec, i, max_tokens=120) for i in range(6)})
    assert sum(r["finish"] == "stop" for r in results.values()) >= 1
    for r in results.values():
        check_json(engine, spec, PERSON, r)
    # Greedy too (the argmax of a masked row).
    greedy = run(engine, {"g": SamplingParams(max_tokens=120, temperature=0, structured=spec)})["g"]
    check_json(engine, spec, PERSON, greedy)


def test_json_object_outputs_parse(engine):
    spec = {"type": "json_object"}
    results = run(engine, {f"o{i}": sampled(spec, i, max_tokens=40) for i in range(6)})
    for r in results.values():
        if r["finish"] == "stop":
            assert isinstance(json.loads(r["text"]), dict)
        else:
            assert isinstance(json.loads(complete(engine, spec, r["tokens"])), dict)


def test_whitespace_options_shape_the_json(engine):
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    schema = {"type": "object", "properties": {"a": digit, "b": digit}, "required": ["a", "b"],
              "additionalProperties": False}
    default = run(engine, {f"d{i}": sampled({"type": "json_schema", "schema": schema}, i) for i in range(3)})
    for r in default.values():   # json.dumps' separators, no other whitespace
        assert re.fullmatch(r'\{"a": \d, "b": \d\}', r["text"]), r
    pattern = {"type": "json_schema", "schema": schema, "whitespace_pattern": "[ ]{2}"}
    for r in run(engine, {f"w{i}": sampled(pattern, i) for i in range(2)}).values():
        # Whitespace may appear where JSON allows it, and only as the pattern says.
        assert re.fullmatch(r'\{(  )?"a"(  )?:(  )?\d(  )?,(  )?"b"(  )?:(  )?\d(  )?\}', r["text"]), r
    flexible = {"type": "json_schema", "schema": schema, "whitespace_flexible": True}
    for r in run(engine, {f"f{i}": sampled(flexible, i, max_tokens=200) for i in range(2)}).values():
        check_json(engine, flexible, schema, r)


def test_regex_outputs_match(engine):
    pattern = r"[0-9]{3}-[a-z]{2,5}(\.[a-z]{1,3})?"
    results = run(engine, {f"r{i}": sampled({"type": "regex", "pattern": pattern}, i, max_tokens=30)
                           for i in range(6)})
    for r in results.values():
        assert r["finish"] == "stop" and re.fullmatch(pattern, r["text"]), r


def test_choice_outputs_are_one_of_the_choices(engine):
    choices = ["yes", "no", "maybe not", "\"quoted\""]
    results = run(engine, {f"c{i}": sampled({"type": "choice", "choices": choices}, i) for i in range(8)})
    assert all(r["text"] in choices and r["finish"] == "stop" for r in results.values())
    assert len({r["text"] for r in results.values()}) > 1   # sampled, not fixed


def test_grammar_outputs_follow_the_grammar(engine):
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c]+'
    results = run(engine, {f"g{i}": sampled({"type": "grammar", "grammar": grammar}, i, max_tokens=40)
                           for i in range(4)})
    for r in results.values():
        if r["finish"] == "stop":
            assert re.fullmatch(r"\([a-c]+(,[a-c]+)*\)", r["text"]), r


def test_cut_by_max_tokens_is_length_and_a_valid_prefix(engine):
    spec = {"type": "json_schema", "schema": PERSON}
    results = run(engine, {f"cut{i}": sampled(spec, i, max_tokens=7) for i in range(4)})
    for r in results.values():
        assert r["finish"] == "length" and len(r["tokens"]) == 7
        with pytest.raises(json.JSONDecodeError):
            json.loads(r["text"])
        jsonschema.validate(json.loads(complete(engine, spec, r["tokens"])), PERSON)


# -- generated schemas -------------------------------------------------------------------------


def _names():
    return st.text(alphabet="abcdefgh_", min_size=1, max_size=6)


_leaf = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 1000)),
    st.just({"type": "integer"}),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.builds(lambda vs: {"enum": vs}, st.lists(st.one_of(st.text("xyz", min_size=1, max_size=3),
                                                          st.integers(-5, 5), st.none()),
                                                min_size=1, max_size=4, unique=True)),
)


def _object(children):
    return st.dictionaries(_names(), children, min_size=1, max_size=4).flatmap(
        lambda props: st.builds(
            lambda required, closed: {"type": "object", "properties": props, "required": required,
                                      **({"additionalProperties": False} if closed else {})},
            st.lists(st.sampled_from(sorted(props)), unique=True), st.booleans()))


schemas = st.recursive(
    _leaf,
    lambda children: st.one_of(
        _object(children),
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 3)),
    ),
    max_leaves=6,
).filter(lambda s: s.get("type") == "object").map(lambda s: {**s, "additionalProperties": False})


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(schema=schemas, seed=st.integers(0, 2**31))
def test_every_output_of_a_generated_schema_validates(engine, schema, seed):
    jsonschema.Draft202012Validator.check_schema(schema)
    spec = {"type": "json_schema", "schema": schema}
    results = run(engine, {f"h{seed}-{i}": sampled(spec, seed + i, max_tokens=60) for i in range(2)})
    for r in results.values():
        check_json(engine, spec, schema, r)


# -- the cache and the batch -------------------------------------------------------------------


def test_one_schema_compiles_once_for_many_requests(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="8MiB", max_model_len=512))
    spec = {"type": "json_schema", "schema": PERSON}
    run(engine, {f"s{i}": sampled(spec, i, max_tokens=10) for i in range(10)})
    run(engine, {f"t{i}": sampled(dict(spec), i, max_tokens=10) for i in range(5)})   # an equal copy
    assert engine.grammars.cache.compiles == 1
    reordered = {**PERSON, "properties": dict(reversed(PERSON["properties"].items()))}
    run(engine, {"u": sampled({"type": "json_schema", "schema": reordered}, 0, max_tokens=10)})
    assert engine.grammars.cache.compiles == 2


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(engine):
    plain = {f"plain{i}": SamplingParams(max_tokens=12, temperature=0, ignore_eos=True) for i in range(3)}
    prompts = {f"plain{i}": [5 + i, 6, 7, 8] for i in range(3)}

    def go(extra):
        for request_id, params in {**plain, **extra}.items():
            engine.add_request(request_id, prompts.get(request_id, PROMPT), params)
        out = {}
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out

    alone = go({})
    mixed = go({f"json{i}": sampled({"type": "json_schema", "schema": PERSON}, i, max_tokens=12) for i in range(3)})
    assert {k: mixed[k] for k in plain} == alone


def test_preemption_keeps_the_matcher_in_step(model_dir):
    # A KV cache too small for all requests at once: the newest are preempted and recomputed.
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="320KiB", max_model_len=512))
    schema = {"type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["text", "n"], "additionalProperties": False}   # a long string: long outputs
    spec = {"type": "json_schema", "schema": schema}
    results = run(engine, {f"pre{i}": sampled(spec, i, max_tokens=150) for i in range(8)}, prompt=list(range(5, 60)))
    assert engine.stats.preemptions > 0
    for r in results.values():
        check_json(engine, spec, schema, r)


def test_requests_wait_for_their_grammar_and_can_be_aborted_meanwhile(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="8MiB", max_model_len=512))
    gate = threading.Event()
    compile_for_real = engine.grammars.cache._compile

    def slow_compile(key, spec):
        gate.wait(10)
        return compile_for_real(key, spec)

    engine.grammars.cache._compile = slow_compile
    spec = {"type": "regex", "pattern": "[ab]{4}"}
    engine.add_request("held", PROMPT, sampled(spec, 1))
    engine.add_request("dropped", PROMPT, sampled(spec, 2))
    engine.add_request("free", PROMPT, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert engine.num_waiting == 1 and engine.grammars.has_held
    outputs = [o for _ in range(3) for o in engine.step()]
    assert {o.request_id for o in outputs} == {"free"}   # nothing sampled for the held ones
    assert engine.abort("dropped")
    gate.set()
    results = {}
    while engine.has_unfinished():
        for o in engine.step():
            results.setdefault(o.request_id, []).append(o)
    assert results["dropped"][-1].finish_reason == "abort" and not results["dropped"][0].new_token_ids
    text = "".join(o.text_delta for o in results["held"])
    assert re.fullmatch("[ab]{4}", text) and results["held"][-1].finish_reason == "stop"
    assert engine.pool.num_free == engine.pool.num_blocks


def test_every_choice_of_an_n_request_has_its_own_matcher(engine):
    """n > 1: the choices fork from the prompt with copies of the parent's matcher, so each
    follows the grammar from its own first token (and they differ: seed + index)."""
    spec = {"type": "json_schema", "schema": PERSON}
    engine.add_request("n4", PROMPT, sampled(spec, 7, max_tokens=120, n=4))
    choices: dict[int, dict] = {}
    finished = []
    while engine.has_unfinished():
        for out in engine.step():
            r = choices.setdefault(out.index, {"tokens": [], "text": "", "finish": None})
            r["tokens"].extend(out.new_token_ids)
            r["text"] += out.text_delta
            r["finish"] = out.finish_reason or r["finish"]
            finished.append(out.finished)
    assert sorted(choices) == [0, 1, 2, 3] and sum(finished) == 1
    assert len({r["text"] for r in choices.values()}) > 1
    for r in choices.values():
        check_json(engine, spec, PERSON, r)


def test_a_held_n_request_aborted_ends_every_choice(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="8MiB", max_model_len=512))
    gate = threading.Event()
    compile_for_real = engine.grammars.cache._compile
    engine.grammars.cache._compile = lambda key, spec: (gate.wait(10), compile_for_real(key, spec))[1]
    engine.add_request("held", PROMPT, sampled({"type": "regex", "pattern": "[ab]{4}"}, 1, n=3))
    assert engine.grammars.has_held and engine.abort("held") and not engine.abort("held")
    gate.set()
    outputs = [o for _ in range(2) for o in engine.step()]
    assert sorted(o.index for o in outputs) == [0, 1, 2]
    assert all(o.finish_reason == "abort" and not o.new_token_ids for o in outputs)
    assert [o.finished for o in outputs].count(True) == 1 and not engine.has_unfinished()


def test_a_bad_spec_is_refused_by_add_request_once_checked(engine):
    """Checked before it reaches the engine (the worker's task thread: prepare_grammar), a bad
    spec is refused by add_request itself."""
    bad = sampled({"type": "regex", "pattern": "(open"}, 0)
    prepare_grammar(engine, bad)
    with pytest.raises(EngineRequestError) as info:
        engine.add_request("bad", PROMPT, bad)
    assert info.value.param == "structured" and "unclosed" in str(info.value)
    assert "bad" not in engine.requests


def slow_validators(monkeypatch, answer=None):
    """A validator pool that takes until `release` is set to answer (a process still starting):
    returns (asked, answered, release) events."""
    from rein.engine.structured import validator

    asked, answered, release = threading.Event(), threading.Event(), threading.Event()

    class Starting:
        size = 1

        def problem(self, key):
            asked.set()
            release.wait(30)
            answered.set()
            if isinstance(answer, Exception):
                raise answer
            return answer

    monkeypatch.setattr(validator, "pool", lambda: Starting())
    return asked, answered, release


def test_the_step_thread_never_waits_for_a_validator(model_dir, monkeypatch):
    """add_request and step return while the spec's check waits for a validator process; the
    request is held meanwhile, and runs once its spec is checked and compiled."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="8MiB", max_model_len=512))
    asked, answered, release = slow_validators(monkeypatch)
    spec = {"type": "regex", "pattern": f"[cd]{{3}}-{uuid.uuid4().hex[:6]}"}   # unchecked in this process
    engine.add_request("held", PROMPT, sampled(spec, 1))
    engine.add_request("free", PROMPT, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    outputs = [o for _ in range(3) for o in engine.step()]
    assert asked.wait(10) and not answered.is_set()   # the check is under way, on another thread
    assert {o.request_id for o in outputs} == {"free"} and engine.grammars.has_held
    release.set()
    results: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            results.setdefault(o.request_id, []).append(o)
    assert re.fullmatch(spec["pattern"], "".join(o.text_delta for o in results["held"]))


def test_a_spec_checked_on_the_compile_thread_ends_its_held_request_with_the_reason(model_dir, monkeypatch):
    from rein.engine.structured.validator import ValidatorUnavailable

    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="8MiB", max_model_len=512))
    _, _, release = slow_validators(monkeypatch, "the grammar crashed rein's grammar compiler")
    bad = {"type": "regex", "pattern": f"[ef]{{2}}-{uuid.uuid4().hex[:6]}"}
    engine.add_request("bad", PROMPT, sampled(bad, 1))   # held: not refused on the step thread
    release.set()
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [(o.finish_reason, o.finished) for o in outputs] == [("abort", True)]
    assert "crashed rein's grammar compiler" in outputs[0].error and not outputs[0].new_token_ids
    # No validator could answer: not a verdict, so not remembered; the next request asks again.
    spec = {"type": "regex", "pattern": f"[gh]{{2}}-{uuid.uuid4().hex[:6]}"}
    _, _, release = slow_validators(monkeypatch, ValidatorUnavailable("all 1 grammar validators stayed busy"))
    release.set()
    with pytest.raises(GrammarError, match="could not be checked: all 1 grammar validators"):
        engine.grammars.prefetch(spec).result(10)
    _, _, release = slow_validators(monkeypatch)
    release.set()
    prepare_grammar(engine, sampled(spec, 1))
    engine.add_request("checked", PROMPT, sampled(spec, 1))
    assert engine.num_waiting == 1 and not engine.grammars.has_held


def test_prepare_grammar_compiles_before_submit(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="8MiB", max_model_len=512))
    spec = {"type": "choice", "choices": ["left", "right"]}
    prepare_grammar(engine, sampled(spec, 0))
    assert engine.grammars.ready(spec)
    engine.add_request("x", PROMPT, sampled(spec, 0))
    assert engine.num_waiting == 1 and not engine.grammars.has_held   # scheduled at once
    prepare_grammar(engine, SamplingParams())   # unconstrained: nothing to do


def test_padded_vocabulary_ids_are_never_allowed(engine):
    padded = engine.spec.vocab_size + 64
    decoding = StructuredDecoding(engine.tokenizer, padded, engine.eos_token_ids)
    spec = {"type": "json_object"}
    decoding.prefetch(spec).result(10)

    class Row:
        grammar = decoding.new_matcher(spec)

    logits = torch.zeros(2, padded)
    decoding.apply_masks(logits, [Row(), type("Free", (), {"grammar": None})()])
    assert torch.isinf(logits[0, engine.spec.vocab_size:]).all()
    assert torch.isfinite(logits[0]).sum() == 1 and logits[0].argmax() == engine.tokenizer.encode("{")[0]
    assert torch.isfinite(logits[1]).all()   # the unconstrained row is untouched
    decoding.close()


def test_cache_is_bounded_and_remembers_failures(engine):
    cache = GrammarCache(engine.tokenizer, engine.spec.vocab_size, sorted(engine.eos_token_ids), max_entries=2)
    specs = [{"type": "regex", "pattern": f"x{i}"} for i in range(3)]
    for spec in specs:
        cache.wait(spec, 10)
    assert len(cache) == 2 and not cache.ready(specs[0]) and cache.ready(specs[2])
    bad = {"type": "regex", "pattern": "(open"}
    with pytest.raises(ValueError):
        cache.wait(bad, 10)
    with pytest.raises(ValueError):
        cache.wait(bad, 10)
    assert cache.compiles == 3
    cache.close()


def test_a_grammar_that_never_compiles_ends_its_request_after_the_deadline(model_dir, monkeypatch):
    from rein.engine.structured import decoding

    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="8MiB", max_model_len=512))
    gate = threading.Event()
    compile_for_real = engine.grammars.cache._compile
    engine.grammars.cache._compile = lambda key, spec: (gate.wait(30), compile_for_real(key, spec))[1]
    monkeypatch.setattr(decoding, "COMPILE_DEADLINE_SECONDS", 0.2)
    engine.add_request("stuck", PROMPT, sampled({"type": "regex", "pattern": "[xy]{3}"}, 1))
    assert engine.grammars.has_held
    outputs = []
    for _ in range(50):
        outputs += engine.step()
        if not engine.has_unfinished():
            break
    gate.set()
    assert [o.finished for o in outputs] == [True] and not engine.grammars.has_held
    assert "stuck" not in engine.requests
    # The job fails with the reason (rein.worker.tasks), rather than reading as cancelled.
    assert outputs[0].finish_reason == "abort" and "did not compile within 0.2 s" in outputs[0].error
    # The scheduler never saw it, and still counts right: the next request runs to its end.
    engine.add_request("next", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    assert engine.has_unfinished() and engine.num_waiting == 1    # (a runner would sleep otherwise)
    finished = []
    for _ in range(50):
        finished += [o for o in engine.step() if o.finished]
        if not engine.has_unfinished():
            break
    assert [(o.request_id, o.finish_reason) for o in finished] == [("next", "length")]


def test_the_worker_compiles_under_rein_parser_limits(engine, monkeypatch):
    from rein.engine.structured import limits

    monkeypatch.setitem(limits.PARSER_LIMITS, "max_grammar_size", 10)
    cache = GrammarCache(engine.tokenizer, engine.spec.vocab_size, sorted(engine.eos_token_ids))
    spec = {"type": "json_schema", "schema": {"type": "object", "properties": {
        f"field_{i}": {"type": "string"} for i in range(20)}}}
    with pytest.raises(ValueError, match="cannot be compiled"):
        cache.wait(spec, 10)
    cache.close()
