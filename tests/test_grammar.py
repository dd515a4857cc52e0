"""Structured output: the constraint's validation, draft filtering and masks (hand-worked table), constrained
decoding that always matches its constraint, greedy speculative == greedy plain under a constraint for chains
and trees, and sampled constrained speculation in the constrained distribution; every test that builds a
grammar runs on both grammar libraries (xgrammar and llguidance), and structural tags (tool calls) on each."""
from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest
import torch
from conftest import MISSING, every_step, needs_default_model
from jsonschema import validate
from test_drafters import other_draft_dir, target_dir  # noqa: F401 (module fixtures)
from test_speculative import MIN_P_VALUE, chi_square_two_sample, p_value

from specdec import LLM, SamplingParams, SpecdecError, StructuredOutput
from specdec.structured import BACKEND_ENV, apply_bitmask, compiler_for, grammar_backend, mask_logits

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "pets"], "additionalProperties": False}
CONSTRAINTS = [
    {"json": PERSON},
    {"json": {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "boolean"}, "c": {"type": "integer", "minimum": -50, "maximum": 50}}, "required": ["b", "c"],
        "additionalProperties": False}}, "required": ["a"], "additionalProperties": False}},
    {"regex": r"[0-9]{1,3}(\.[0-9]{1,2})? (the|a) [a-z]{2,8}"},
    {"choice": ["yes", "no", "maybe later"]},
    {"grammar": 'root ::= "(" num ("+" num)? ("+" num)? ")"\nnum ::= [1-9] [0-9]?'},
]
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"]}


def tool_tag(name: str, schema: dict = WEATHER) -> dict:
    """A tool call as Hermes-style chat templates write it."""
    return {"type": "tag", "begin": f'<tool_call>{{"name": "{name}", "arguments": ',
            "content": {"type": "json_schema", "json_schema": schema}, "end": "}</tool_call>"}


def structural_tag(fmt: dict) -> dict:
    return {"structural_tag": {"type": "structural_tag", "format": fmt}}


# a named tool call (tool_choice naming one function, no parallel calls)
NAMED_CALL = structural_tag({"type": "tags_with_separator", "tags": [tool_tag("weather")], "separator": "\n",
                             "at_least_one": True, "stop_after_first": True})
CONSTRAINTS.append(NAMED_CALL)


def satisfies(text: str, constraint: dict) -> bool:
    if "structural_tag" in constraint:
        tag = constraint["structural_tag"]["format"]["tags"][0]
        assert text.startswith(tag["begin"]) and text.endswith(tag["end"]), text
        validate(json.loads(text[len(tag["begin"]):-len(tag["end"])]), tag["content"]["json_schema"])
        return True
    if "json" in constraint:
        validate(json.loads(text), constraint["json"])
        return True
    if "regex" in constraint:
        return re.fullmatch(constraint["regex"], text) is not None
    if "choice" in constraint:
        return text in constraint["choice"]
    return re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?){0,2}\)", text) is not None


def constrained(constraint: dict, max_tokens: int = 48, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_output=constraint, **kw)


PROMPTS = [[1, 60, 61, 62, 63], [1, 100, 101, 100, 101, 100], [1, 45, 200, 45, 200]]


# -- the constraint itself ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"choice": ["a", ""]}, "choice must be a non-empty list"),
    ({"regex": 3}, "regex must be a non-empty string"),
    ({"json": 5}, "json must be a JSON schema"),
    ({"grammar": "root ::= \"a\"", "grammar_syntax": "yaml"}, "grammar_syntax"),
    ({"jsn": {}}, "unknown StructuredOutput key"),
])
def test_malformed_constraints_are_refused_when_built(fields, message):
    with pytest.raises(SpecdecError, match=message):
        SamplingParams(structured_output=fields)


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend(request):
    """The grammar library of the module's engines, each in turn (SPECDEC_GRAMMAR_BACKEND while they run)."""
    if importlib.util.find_spec(request.param) is None:
        pytest.skip(f"{MISSING} the {request.param} package (pip install llguidance; xgrammar: see the README)")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(BACKEND_ENV, request.param)
        yield request.param


@pytest.fixture(scope="module")
def plain(target_dir, backend):  # noqa: F811
    return LLM(str(target_dir), speculative_config="off", max_num_seqs=256)


def test_the_grammar_backend_is_the_chosen_one_else_the_installed_one(monkeypatch):
    """SPECDEC_GRAMMAR_BACKEND chooses; unset, xgrammar where it imports, else llguidance; neither: an error
    naming both."""
    monkeypatch.setenv(BACKEND_ENV, "llguidance")
    assert grammar_backend() == "llguidance"
    monkeypatch.setenv(BACKEND_ENV, "outlines")
    with pytest.raises(SpecdecError, match="expected xgrammar or llguidance"):
        grammar_backend()
    monkeypatch.delenv(BACKEND_ENV)

    def without(*names):  # a module set to None in sys.modules raises ImportError on import
        for name in names:
            monkeypatch.setitem(sys.modules, name, None)

    without()
    assert grammar_backend() == ("xgrammar" if importlib.util.find_spec("xgrammar") else "llguidance")
    without("xgrammar")
    assert grammar_backend() == "llguidance"
    without("xgrammar", "llguidance")
    with pytest.raises(SpecdecError, match="pip install llguidance.*xgrammar"):
        grammar_backend()


@pytest.mark.parametrize("constraint, field", [
    ({"regex": "[a-"}, "structured_output.regex"),
    ({"json": "{not json"}, "structured_output.json is not valid JSON"),
    ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "structured_output.json"),
    ({"grammar": "root ::= (("}, "structured_output.grammar"),
    ({"grammar": "start: (", "grammar_syntax": "lark"}, "structured_output.grammar"),
    ({"json": {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}},
     "the keyword 'uniqueItems' at #/properties/tags is not supported"),
    ({"json": {"type": "integer", "not": {"const": 3}}}, "the keyword 'not' at # is not supported"),
    ({"json": {"allOf": [{"type": "integer"}, {"minimum": 3}]}}, "'allOf' with 2 schemas"),
])
def test_constraints_that_do_not_compile_or_cannot_be_enforced_name_the_field_and_admit_nothing(
        plain, constraint, field):
    with pytest.raises(SpecdecError, match=re.escape(field)):
        plain.generate([{"prompt_token_ids": PROMPTS[0]}], constrained(constraint))
    assert not plain.engine.has_unfinished() and plain.engine.allocator.num_used == 0


# -- draft filtering and masks (hand-worked) ----------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(plain):
    return plain.tokenizer


def ids(tokenizer, *pieces: str) -> list[int]:
    out = [tokenizer.convert_tokens_to_ids(p) for p in pieces]
    assert all(isinstance(i, int) and i >= 0 for i in out)
    return out


def test_a_draft_tree_is_filtered_by_its_paths_and_masked_per_node(plain, tokenizer):
    """Choice among "ab", "ac" and "x". Draft tree (parents in brackets): 0 a [-1], 1 x [-1], 2 b [0], 3 c [0],
    4 q [0], 5 b [4], 6 z [1]. q after "a" is forbidden: dropped with its child 5; z after "x" is forbidden
    (only the end of text may follow). Kept: a, x, b, c re-indexed as 0, 1, 2, 3 with parents -1, -1, 0, 0."""
    a, b, c, x, q, z = ids(tokenizer, "a", "b", "c", "x", "q", "z")
    eos = tokenizer.eos_token_id
    compiler = compiler_for(tokenizer, plain.engine.model.config.vocab_size, [eos])
    state = compiler.state(StructuredOutput(choice=["ab", "ac", "x"]))
    kept, parents, origin = state.filter_draft([a, x, b, c, q, b, z], [-1, -1, 0, 0, 0, 4, 1])
    assert (kept, parents, origin) == ([a, x, b, c], [-1, -1, 0, 0], [0, 1, 2, 3])
    masks = state.masks(kept, parents)
    assert masks.shape == (5, state.width)

    def allowed(row: int) -> set[int]:
        logits = torch.zeros(1, plain.engine.model.config.vocab_size)
        apply_bitmask(logits, masks[row:row + 1])
        return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())

    assert {a, x} <= allowed(0) and q not in allowed(0)  # root: the first tokens of the choices
    assert allowed(1) >= {b, c} and not allowed(1) & {a, x, q, eos}  # after "a"
    assert allowed(2) == allowed(3) == allowed(4) == {eos}  # after "x", "ab", "ac": only the end
    # the target's choices per row: x at the root (allowed), q after "a" (refused), eos after "x" (allowed),
    # b after "ab" (refused), eos after "ac" (allowed): only the refused rows need a mask
    assert state.refused_rows(kept, parents, [x, q, eos, b, eos]) == [1, 3]
    only = state.masks(kept, parents, rows=[1, 3])
    assert torch.equal(only[1], masks[1]) and torch.equal(only[3], masks[3]) and bool((only[[0, 2, 4]] == -1).all())
    assert state.accept(a) and state.accept(b) and state.accept(eos)  # every walk left the state at the root


def test_greedy_rows_are_masked_only_where_the_argmax_is_refused(plain, tokenizer):
    """Two requests in one logits tensor: a greedy one whose argmax the grammar allows (left as it is) and a
    sampled one (masked); then a greedy one whose argmax is refused (masked, its argmax moves to an allowed
    token)."""
    a, x, q = ids(tokenizer, "a", "x", "q")
    V = plain.engine.model.config.vocab_size
    compiler = compiler_for(tokenizer, V, [tokenizer.eos_token_id])
    so = StructuredOutput(choice=["ab", "x"])
    logits = torch.randn(2, V)
    logits[:, a] = 50.0
    out = logits.clone()
    mask_logits(out, [(compiler.state(so), [], [], True), (compiler.state(so), [], [], False)])
    assert torch.equal(out[0], logits[0])
    assert set(torch.isfinite(out[1]).nonzero().flatten().tolist()) >= {a, x} and torch.isinf(out[1, q])
    refused = torch.randn(1, V)
    refused[0, q] = 50.0
    mask_logits(refused, [(compiler.state(so), [], [], True)])
    assert int(refused.argmax()) in (a, x) and torch.isinf(refused[0, q])


def test_a_greedy_chain_is_masked_as_far_as_verification_walks(plain, tokenizer):
    """Choice among "ab" and "x", draft chain a, b (rows: root, after "a", after "ab"). Row 0's argmax q is
    refused; masked, it is a, the draft's token, so verification goes on: row 1 agrees (b), row 2's q is
    refused and masked to the end of text. When row 0's masked argmax is x instead, verification stops there
    and rows 1 and 2 are left as they are (their q stays)."""
    a, b, x, q = ids(tokenizer, "a", "b", "x", "q")
    eos = tokenizer.eos_token_id
    V = plain.engine.model.config.vocab_size
    compiler = compiler_for(tokenizer, V, [eos])
    so = StructuredOutput(choice=["ab", "x"])
    logits = torch.zeros(3, V)
    logits[:, q] = 50.0
    logits[0, a], logits[1, b], logits[2, eos] = 40.0, 60.0, 30.0
    out = logits.clone()
    top = mask_logits(out, [(compiler.state(so), [a, b], [-1, 0], True)])
    assert top == [a, b, eos] and torch.isinf(out[0, q]) and torch.equal(out[1], logits[1]) and torch.isinf(out[2, q])
    logits[0, x] = 45.0
    out = logits.clone()
    top = mask_logits(out, [(compiler.state(so), [a, b], [-1, 0], True)])
    assert top == [x, b, q] and torch.equal(out[1:], logits[1:])


def test_a_chain_is_extended_by_the_text_the_grammar_forces(plain, tokenizer):
    """One choice, "hello world": with nothing drafted, the jump-forward text is drafted as far as the limit,
    then the stop token, the one token allowed once the text is complete; a draft the grammar refuses is
    dropped and the forced text drafted instead; a draft that spells the forced text with other tokens is
    kept, and the rest of the text follows it."""
    eos = tokenizer.eos_token_id
    compiler = compiler_for(tokenizer, plain.engine.model.config.vocab_size, [eos])
    state = compiler.state(StructuredOutput(choice=["hello world"]))
    forced = tokenizer.encode("hello world", add_special_tokens=False)
    assert forced == ids(tokenizer, "he", "ll", "o", "Ġ", "w", "or", "ld")
    kept, parents, origin = state.filter_draft([], [], tokenizer, limit=16)
    assert kept == forced + [eos] and parents == list(range(-1, len(forced))) and origin == [-1] * (len(forced) + 1)
    assert state.filter_draft([], [], tokenizer, limit=2)[0] == forced[:2]
    assert state.filter_draft([], [], tokenizer, limit=len(forced))[0] == forced  # no room left for the stop
    kept, _, origin = state.filter_draft(ids(tokenizer, "z"), [-1], tokenizer, limit=16)
    assert kept == forced + [eos] and origin == [-1] * (len(forced) + 1)  # z contradicted the forced text
    kept, _, origin = state.filter_draft(forced[:2], [-1, 0], tokenizer, limit=16)
    assert kept == forced + [eos] and origin == [0, 1] + [-1] * (len(forced) - 1)  # a right guess, then the rest
    other = ids(tokenizer, "h", "e", "l")  # "hel" in other tokens: the grammar accepts them, so they stay
    kept, parents, origin = state.filter_draft(other, [-1, 0, 1], tokenizer, limit=16)
    rest = tokenizer.encode("lo world", add_special_tokens=False) + [eos]
    assert kept == other + rest and parents == list(range(-1, len(kept) - 1)) and origin == [0, 1, 2] + [-1] * len(rest)
    # where the text may go on ("ab" or "abc"), its end is not forced: no stop token is drafted after "ab"
    state = compiler.state(StructuredOutput(choice=["ab", "abc"]))
    assert eos not in state.filter_draft(ids(tokenizer, "a", "b"), [-1, 0], tokenizer, limit=16)[0]
    assert state.accept(ids(tokenizer, "a")[0])  # every walk left the state where it was


@pytest.mark.parametrize("where", ['{"o": {"s": "a', '{"o": {"s": "abc", "n": 1', '{"o": {'])
def test_draft_walks_roll_back_inside_strings_numbers_and_nested_objects(plain, tokenizer, where):
    """After a step's draft walks (filtering a tree with a refused branch, masking every row, checking the
    target's choices), the state is where the committed tokens left it, inside a string, a number or a nested
    object: its mask equals a fresh state's, and the rest of the text is accepted to the end."""
    schema = {"type": "object", "properties": {"o": {"type": "object", "properties": {
        "s": {"type": "string"}, "n": {"type": "integer"}}, "required": ["s", "n"]}}, "required": ["o"]}
    text = '{"o": {"s": "abc", "n": 123}}'
    eos = tokenizer.eos_token_id
    compiler = compiler_for(tokenizer, plain.engine.model.config.vocab_size, [eos])
    so = StructuredOutput(json=schema)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    cut = next(i for i in range(len(tokens) + 1) if tokenizer.decode(tokens[:i]) == where)
    state, fresh = compiler.state(so), compiler.state(so)
    for t in tokens[:cut]:
        assert state.accept(t) and fresh.accept(t)
    good = tokens[cut:cut + 5]
    bad = tokenizer.encode("}}}", add_special_tokens=False)[:1]  # a second branch: "}" (refused but in the string)
    draft = good + bad + good[:2]
    parents = list(range(-1, len(good) - 1)) + [-1, len(good), len(good) + 1]
    kept, kept_parents, _ = state.filter_draft(draft, parents, tokenizer, limit=8)
    assert kept[:len(good)] == good
    state.masks(kept, kept_parents)
    state.refused_rows(kept, kept_parents, [bad[0]] * (1 + len(kept)))
    assert torch.equal(state.masks([], []), fresh.masks([], []))
    assert all(state.accept(t) for t in tokens[cut:] + [eos]) and state.terminated


# -- structural tags (tool calls) ------------------------------------------------------------------------------
def accepts(compiler, tokenizer, constraint: dict, text: str, eos: int | None = None) -> bool:
    """Whether a fresh state takes the tokens of `text` (and then the stop token `eos`, if given)."""
    state = compiler.state(StructuredOutput(**constraint))
    tokens = tokenizer.encode(text, add_special_tokens=False) + ([eos] if eos is not None else [])
    return all(state.accept(t) for t in tokens)


@pytest.fixture(scope="module")
def compiler(plain, tokenizer, backend):
    out = compiler_for(tokenizer, plain.engine.model.config.vocab_size, [tokenizer.eos_token_id])
    assert type(out).__name__ == {"xgrammar": "XGrammarCompiler", "llguidance": "LLGuidanceCompiler"}[backend]
    return out


def call(name: str, arguments: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


def test_a_named_tool_call_takes_only_arguments_its_schema_allows(compiler, tokenizer):
    """One call of `weather` (tags_with_separator, at least one, stop after the first): its arguments are
    compact JSON valid under the schema, nothing else (another enum value, a missing or an extra key, other
    spacing, a second call, text around it); the begin and the first key are forced text, drafted for free."""
    eos = tokenizer.eos_token_id
    good = call("weather", '{"city": "Rome", "days": 3}')
    assert accepts(compiler, tokenizer, NAMED_CALL, good, eos)
    for bad in [call("weather", '{"city": "Oslo", "days": 3}'), call("weather", '{"city": "Rome"}'),
                call("weather", '{"city": "Rome", "days": 3, "hours": 1}'), call("weather", '{"city":"Rome","days":3}'),
                call("weather", '{"city": "Rome", "days": 10}'), call("other", '{"city": "Rome", "days": 3}'),
                good + "\n" + good, "Sure. " + good, good + " done"]:
        assert not accepts(compiler, tokenizer, NAMED_CALL, bad, eos), bad
    state = compiler.state(StructuredOutput(**NAMED_CALL))
    forced = tokenizer.decode(state.filter_draft([], [], tokenizer, limit=64)[0])
    assert forced == '<tool_call>{"name": "weather", "arguments": {"city": "'


def test_parallel_tool_calls_are_separated_tags(compiler, tokenizer):
    """tags_with_separator without stop_after_first: one or more calls of either tool, a newline between."""
    eos = tokenizer.eos_token_id
    time_schema = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}
    tags = [tool_tag("weather"), tool_tag("time", time_schema)]
    parallel = structural_tag({"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                               "stop_after_first": False})
    weather, time_ = call("weather", '{"city": "Paris", "days": 1}'), call("time", '{"zone": "CET"}')
    for good in [weather, time_, weather + "\n" + time_, time_ + "\n" + time_ + "\n" + weather]:
        assert accepts(compiler, tokenizer, parallel, good, eos), good
    for bad in ["", weather + time_, weather + "\n", weather + "\n" + call("time", '{"zone": 5}')]:
        assert not accepts(compiler, tokenizer, parallel, bad, eos), bad


def test_triggered_tags_take_free_text_and_a_tag_where_the_trigger_appears(compiler, tokenizer):
    """Tool choice "auto" (triggered_tags): any text, but once the trigger appears, a whole valid call; text
    may follow it (not with stop_after_first). After the trigger, the rest of the call's begin is forced text."""
    eos = tokenizer.eos_token_id
    auto = structural_tag({"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [tool_tag("weather")],
                           "at_least_one": False, "stop_after_first": False})
    good = call("weather", '{"city": "Paris", "days": 2}')
    for text in ["", "No tool is needed.", "Let me look. " + good, good + " Done.", good + good, "a <tool_cal b"]:
        assert accepts(compiler, tokenizer, auto, text, eos), text
    for bad in ["Let me look. <tool_call>{}", "x <tool_call>" + '{"name": "other"',
                "Look: " + call("weather", '{"city": "Oslo", "days": 2}')]:
        assert not accepts(compiler, tokenizer, auto, bad), bad
    state = compiler.state(StructuredOutput(**auto))
    assert all(state.accept(t) for t in tokenizer.encode("Checking <tool_call>", add_special_tokens=False))
    forced = state.filter_draft([], [], tokenizer, limit=64)[0]
    assert tokenizer.decode(forced) == '{"name": "weather", "arguments": {"city": "'
    auto["structural_tag"]["format"]["stop_after_first"] = True  # no parallel calls: the output ends with one
    assert accepts(compiler, tokenizer, auto, "Let me look. " + good, eos)
    assert not accepts(compiler, tokenizer, auto, good + " Done.", eos)


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "string", "pattern": "[0-2][0-9]:[0-5][0-9]"}, '"10:55"', '"at 10:55"'),  # the pattern is the string
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a": 1}', '{"a": 1, "b": 2}'),  # listed keys
    ({"type": "array", "prefixItems": [{"type": "integer"}]}, "[1]", "[1, 2]"),  # listed items
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": False}, "[1, 1]", "[1,1]"),  # compact
    ({"type": "string"}, '"caf\\u00e9"', '"a\x01"'),  # an escape; a raw control character is not JSON
], ids=["pattern", "properties", "prefixItems", "separators", "escapes"])
def test_both_backends_read_a_schema_alike(compiler, tokenizer, schema, good, bad):
    """llguidance follows JSON Schema where xgrammar reads it its own way; the backend is written to read it
    as xgrammar does, so a request's output does not depend on the library (a search pattern let the default
    model run on inside a string: any text holding a time matched)."""
    eos = tokenizer.eos_token_id
    assert accepts(compiler, tokenizer, {"json": schema}, good, eos)
    assert not accepts(compiler, tokenizer, {"json": schema}, bad, eos)


@pytest.mark.parametrize("constraint, text", [
    (CONSTRAINTS[0], '{"name": "Ann", "age": 31, "pets": ["cat"]}'),
    (CONSTRAINTS[2], "12.5 the cat"),
    (CONSTRAINTS[4], "(12+3)"),
    (NAMED_CALL, call("weather", '{"city": "Rome", "days": 3}')),
    (structural_tag({"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [tool_tag("weather")]}),
     "Look: " + call("weather", '{"city": "Rome", "days": 3}') + " ok"),
], ids=["json", "regex", "ebnf", "named call", "triggered tags"])
def test_a_mask_allows_exactly_the_tokens_accept_takes(compiler, plain, tokenizer, constraint, text):
    """A greedy row is masked only where `accept` refuses its argmax, so the two must agree: after every prefix
    of a valid text, the mask's tokens are those the grammar accepts (the stop token where it may end)."""
    V = plain.engine.model.config.vocab_size
    state = compiler.state(StructuredOutput(**constraint))
    for token in tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]:
        mask = state.masks([], [])[0]
        masked = ((mask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten()[:V]
        accepted = torch.tensor([not state.refused_rows([], [], [t]) for t in range(V)])
        assert torch.equal(masked, accepted), tokenizer.decode((masked ^ accepted).nonzero().flatten().tolist())
        assert state.accept(token)
    assert state.terminated


def test_the_mask_kernel_matches_the_tensor_path():
    torch.manual_seed(0)
    V = 1000
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, (V + 31) // 32), dtype=torch.int32)
    bitmask[1] = 0
    bitmask[2] = -1
    logits = torch.randn(3, V)
    native = logits.clone()
    apply_bitmask(native, bitmask)
    bits = ((bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten(1)[:, :V]
    assert torch.equal(native, logits.masked_fill(~bits, float("-inf")))
    assert torch.isinf(native[1]).all() and torch.equal(native[2], logits[2])


# -- engine: constrained decoding, plain and speculative ------------------------------------------------------
def test_constrained_outputs_satisfy_their_constraint(plain):
    """Every constraint, on every prompt, greedy and sampled, in one batch with an unconstrained request."""
    params = [constrained(c, 128) for c in CONSTRAINTS] + \
        [SamplingParams(temperature=1.0, seed=s, max_tokens=128, structured_output=c)
         for s, c in enumerate(CONSTRAINTS)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for prompt in prompts:
        outs = plain.generate([prompt] * (len(params) + 1), params + [SamplingParams(temperature=0, max_tokens=8)])
        for out, p in zip(outs, params):
            assert out.finish_reason == "stop", (out.text, p.structured_output)
            assert satisfies(out.text, _as_dict(p.structured_output)), out.text


def _as_dict(so: StructuredOutput) -> dict:
    return {so.kind: getattr(so, so.kind)}


SPECS = {
    "ngram chain": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    "ngram tree": {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "ngram_branches": 2},
    "draft model chain": {"method": "draft_model", "num_speculative_tokens": 4},
    "draft model tree": {"method": "draft_model", "tree": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]},
    "suffix": {"method": "suffix", "num_speculative_tokens": 6},
}


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_constrained_speculation_equals_constrained_plain(target_dir, other_draft_dir, plain, name):
    cfg = dict(SPECS[name])
    if cfg["method"] == "draft_model":
        cfg["model"] = str(other_draft_dir)
    spec = LLM(str(target_dir), speculative_config=every_step(cfg), max_num_seqs=64)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS for _ in CONSTRAINTS]
    params = [constrained(c, 64) for _ in PROMPTS for c in CONSTRAINTS]
    expected = plain.generate(prompts, params)
    for batch in (1, len(prompts)):  # one at a time (chains, trees) and all together
        outs = [o for i in range(0, len(prompts), batch)
                for o in spec.generate(prompts[i:i + batch], params[i:i + batch])]
        assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    drafted = sum(o.metrics["num_draft_tokens"] for o in outs)
    accepted = sum(o.metrics["num_accepted_tokens"] for o in outs)
    assert 0 < accepted < drafted  # drafts were kept and rejected (rolled back) inside the constrained text
    assert spec.engine.allocator.num_used == 0


def test_forced_text_is_drafted_where_the_dispatcher_drafts_nothing(target_dir, plain):
    """A choice of one long string, with a config whose drafter is off at every batch size: steps of a batch
    holding a structured request still draft the grammar's forced text (jump-forward), and the target (random
    weights, its own segmentation) keeps part of it; an unconstrained request beside it decodes as plain."""
    text = "the quick brown fox jumps over the lazy dog"
    spec = LLM(str(target_dir), speculative_config=every_step({"method": "ngram", "num_speculative_tokens": 4,
                                                               "tree": "off"}))
    prompts = [{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}]
    params = [constrained({"choice": [text]}), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    with spec.measuring.trace_speculation() as trace:
        outs = spec.generate(prompts, params)
    expected = plain.generate(prompts, params)
    assert outs[0].text == text and [o.token_ids for o in outs] == [e.token_ids for e in expected]
    assert outs[0].metrics["num_accepted_tokens"] >= 4 and outs[0].metrics["num_steps"] < len(outs[0].token_ids) - 3
    assert outs[1].metrics["num_draft_tokens"] == 0 and trace
    off = LLM(str(target_dir), speculative_config=every_step({"method": "ngram", "tree": "off", "jump_forward": 0}))
    with off.measuring.trace_speculation() as trace:
        assert off.generate(prompts, params)[0].token_ids == expected[0].token_ids
    assert not trace  # nothing to draft: every decode step took the plain path


def test_a_finished_grammar_ends_the_request_even_under_ignore_eos(plain):
    out = plain.generate([{"prompt_token_ids": PROMPTS[0]}],
                         constrained({"choice": ["yes", "no"]}, 50, ignore_eos=True))[0]
    assert out.finish_reason == "stop" and len(out.token_ids) <= 4
    assert "no token may follow" in str(out.stop_reason) or out.stop_reason == plain.tokenizer.eos_token_id


@pytest.mark.parametrize("name", ["draft model chain", "ngram tree"])
def test_sampled_constrained_speculation_keeps_the_constrained_distribution(target_dir, other_draft_dir, plain,
                                                                           name):
    """Tokens 1-3 at temperature 1 under a regex that leaves many tokens open: two-sample chi-square per
    position between constrained plain and constrained speculative decoding (failing under a p-value
    of 1e-4). The draft model's q is renormalized over the allowed tokens where it drafted."""
    cfg = dict(SPECS[name])
    if cfg["method"] == "draft_model":
        cfg["model"] = str(other_draft_dir)
    spec = LLM(str(target_dir), speculative_config=every_step(cfg), max_num_seqs=256)
    n, last = 2000, 3
    regex = r"[a-z ]{1,40}"
    prompts = [{"prompt_token_ids": PROMPTS[1]}] * n
    params = [SamplingParams(temperature=1.0, top_k=8, max_tokens=last + 2, seed=i,
                             structured_output={"regex": regex}) for i in range(n)]
    a_outs = plain.generate(prompts, params)
    outs = spec.generate(prompts, params)
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 50  # drafts were kept and rejected
    assert all(re.fullmatch(regex, o.text) for o in outs if o.finish_reason == "stop")

    def column(outputs, pos):
        return torch.tensor([o.token_ids[pos] if len(o.token_ids) > pos else -1 for o in outputs])

    for pos in range(last):
        chi2, dof = chi_square_two_sample(column(a_outs, pos), column(outs, pos))
        assert dof >= 1 and p_value(chi2, dof) >= MIN_P_VALUE, (pos, chi2, dof)


# -- the default model -----------------------------------------------------------------------------------------
REGEXES = [(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", "On what date did the Apollo 11 landing happen? Answer as YYYY-MM-DD."),
           (r"\(?[0-9]{3}\)? [0-9]{3}-[0-9]{4}", "Write a made-up US phone number."),
           (r"[A-Z][a-z]{1,15}( [A-Z][a-z]{1,15})?", "Name the capital of Italy.")]
CHOICES = [(["positive", "negative", "neutral"], "Classify the sentiment: 'The food was cold and the waiter rude.'"),
           (["math", "history", "biology", "music"], "Which subject is this about: 'Mitochondria make ATP.'")]


@pytest.fixture(scope="module")
def smol(backend):
    return LLM("smollm2-135m", speculative_config="off", max_num_seqs=128)


def structured_requests(llm: LLM) -> list[tuple[list[int], SamplingParams, dict]]:
    """100 constrained requests: the 20 JSON-extraction tasks greedy and at temperatures 0.7 and 1.0 (60),
    3 regexes and 2 choices on 8 seeds each (40)."""
    from specdec.bench.structured import DEFAULT_PROMPTS, extraction_prompt, load_tasks

    out = []
    for i, task in enumerate(load_tasks(DEFAULT_PROMPTS)):
        ids = llm.apply_chat_template(extraction_prompt(task))
        for temperature in (0.0, 0.7, 1.0):
            out.append((ids, SamplingParams(temperature=temperature, seed=i, max_tokens=256,
                                            structured_output={"json": task["schema"]}), {"json": task["schema"]}))
    for constraint, question in [({"regex": r}, q) for r, q in REGEXES] + [({"choice": c}, q) for c, q in CHOICES]:
        ids = llm.apply_chat_template([{"role": "user", "content": question}])
        for seed in range(8):
            out.append((ids, SamplingParams(temperature=0.0 if seed == 0 else 0.8, seed=seed, max_tokens=64,
                                            structured_output=constraint), constraint))
    return out


@needs_default_model
def test_100_constrained_generations_on_the_default_model_are_all_valid(smol):
    requests = structured_requests(smol)
    assert len(requests) == 100
    outs = smol.generate([{"prompt_token_ids": ids} for ids, _, _ in requests], [p for _, p, _ in requests])
    for out, (_, _, constraint) in zip(outs, requests):
        assert out.finish_reason == "stop" and satisfies(out.text, constraint), (out.text, constraint)
    assert smol.engine.allocator.num_used == 0


@needs_default_model
@pytest.mark.parametrize("config", [
    {"method": "ngram", "num_speculative_tokens": 4},
    {"method": "suffix", "num_speculative_tokens": 8},
    {"method": "eagle3", "num_speculative_tokens": 3},
    {"method": "eagle3", "tree": "D2-BF2"},
    {"method": "ngram", "num_speculative_tokens": 6, "ngram_branches": 2, "jump_forward": False},
], ids=["ngram", "suffix", "eagle3", "eagle3-tree", "ngram-tree-no-jump-forward"])
def test_greedy_constrained_speculation_on_the_default_model_equals_plain(smol, config):
    from specdec.models.loader import shipped_head

    if config["method"] == "eagle3":
        config = {**config, "model": str(shipped_head("smollm2-135m"))}
    requests = [r for r in structured_requests(smol) if r[1].greedy][:12]
    prompts = [{"prompt_token_ids": ids} for ids, _, _ in requests]
    params = [p for _, p, _ in requests]
    expected = smol.generate(prompts, params)
    spec = smol.with_speculative_config(every_step(config))
    outs = spec.generate(prompts[:6], params[:6]) + [spec.generate(p, q)[0] for p, q in zip(prompts[6:], params[6:])]
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    accepted = sum(o.metrics["num_accepted_tokens"] for o in outs)
    assert 0 < accepted < sum(o.metrics["num_draft_tokens"] for o in outs)  # and rejected drafts rolled back
    assert spec.engine.allocator.num_used == 0
