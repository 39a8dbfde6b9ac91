"""Constrained decoding (llguidance), logit_bias and tool-call formats in the engine, on a tiny random Llama with a
byte-level tokenizer (the demo's): outputs against their schemas, and tokens against transformers + PEFT with the
grammar's own masks."""

import json
import random

import jsonschema
import llguidance
import pytest
import torch

import kernels
from engine import LLM, SamplingParams
from engine.demo import corpus
from engine.demo.tokenizer import save_tokenizer, train_tokenizer
from engine.demo.trainer import llama_config, new_base_model
from engine.grammar import MAX_GRAMMAR_BYTES, GrammarCompiler, GrammarError, GrammarSpec
from engine.server.protocol import BadRequest, GenerateRequest, PromptSpec, parse_generate
from engine.server.structured import plan
from engine.tool_calls import FORMATS, Hermes, Llama3Json, Mistral, ToolCallStream, format_for_template
from tests.engine.conftest import Oracle, build_adapter
from tests.engine.structured_schemas import random_schema

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
}, "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["paris", "oslo"]},
                                                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}}  # fmt: skip
CLOCK = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                            "required": ["zone"], "additionalProperties": False}}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("structured-model")
    tokenizer = train_tokenizer(corpus.tokenizer_corpus(random.Random(0), lines=200), vocab_size=600)
    save_tokenizer(tokenizer, out, max_length=1024)
    new_base_model(llama_config(tokenizer, hidden=64, layers=2, max_positions=1024), seed=0).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapter_dirs(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("structured-adapters")
    return {"a": build_adapter(model_dir, root / "a", seed=1, r=4, targets=["q_proj", "v_proj", "down_proj"]),
            "b": build_adapter(model_dir, root / "b", seed=2, r=8, targets=["k_proj", "o_proj", "up_proj"])}


@pytest.fixture(scope="module")
def llm(model_dir, adapter_dirs):
    llm = LLM(model_dir, max_num_seqs=256, max_adapter_rank=8)
    for name, path in adapter_dirs.items():
        llm.add_adapter(name, path)
    return llm


@pytest.fixture(scope="module")
def oracle(model_dir, adapter_dirs):
    return Oracle(model_dir, adapter_dirs)


def prompt(llm, text="the cat sees a red ball"):
    return llm.tokenizer.encode(text)


def test_two_hundred_random_schemas_in_one_batch_all_validate(llm):
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(200)]
    adapters = [(None, "a", "b")[i % 3] for i in range(200)]
    sampling = [SamplingParams(max_tokens=200, temperature=1.0, seed=i) for i in range(200)]
    outputs = llm.generate([prompt(llm)] * 200, sampling, adapters=adapters,
                           grammars=[GrammarSpec.json_schema(s, param="response_format") for s in schemas])
    for schema, output in zip(schemas, outputs, strict=True):
        assert output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(output.text), schema)
    kinds = json.dumps(schemas)
    for keyword in ('"enum"', '"minimum"', '"maxItems"', '"anyOf"', '"type": "object", "properties": {"'):
        assert keyword in kinds  # the schemas cover what they claim to


def masked_greedy(oracle, llm, token_ids, adapter, spec, max_tokens):
    """transformers + PEFT's greedy tokens with llguidance's mask applied to each step's logits."""
    matcher = llguidance.LLMatcher(llm.engine.grammars.tokenizer, spec.llguidance_grammar())
    tokens, out = list(token_ids), []
    for _ in range(max_tokens):
        logits = oracle.logits(tokens, adapter)[-1]
        mask = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
        allowed = ((mask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)[: logits.shape[0]].bool()
        token = int(logits.masked_fill(~allowed, -float("inf")).argmax())
        out.append(token)
        if token in llm.engine.eos_token_ids:
            break
        assert matcher.consume_token(token)
        tokens.append(token)
    return out


def test_constrained_and_free_requests_on_adapters_share_a_batch_and_match_peft(llm, oracle):
    spec = GrammarSpec.json_schema(PERSON, param="response_format")
    prompts = [prompt(llm, t) for t in ("the cat sees a red ball", "a dog likes the moon", "my friend paints",
                                        "the robot finds an apple")]
    adapters = ["a", "b", None, "a"]
    grammars = [spec, None, spec, None]
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    outputs = llm.generate(prompts, greedy, adapters=adapters, grammars=grammars)
    for p, adapter, grammar, output in zip(prompts, adapters, grammars, outputs, strict=True):
        if grammar is None:
            assert output.token_ids == oracle.greedy(p, adapter, len(output.token_ids))
        else:
            expected = masked_greedy(oracle, llm, p, adapter, grammar, 40)
            assert output.token_ids == expected
            jsonschema.validate(json.loads(output.text), PERSON)


def test_logit_bias_matches_transformers(llm, oracle):
    p = prompt(llm)
    first = oracle.greedy(p, "a", 1)[0]
    favoured = (first + 7) % 600
    bias = {first: -100.0, favoured: 30.0}
    output = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=3, logit_bias=bias), adapters=["a"])[0]
    tokens = list(p)
    for token in output.token_ids:
        logits = oracle.logits(tokens, "a")[-1]
        logits[list(bias)] += torch.tensor(list(bias.values()))
        assert token == int(logits.argmax())
        tokens.append(token)
    assert output.token_ids[0] == favoured


def test_a_constrained_request_cut_by_max_tokens_ends_with_length_and_its_partial_output(llm):
    spec = GrammarSpec.json_schema(PERSON, param="response_format")
    output = llm.generate([prompt(llm)], SamplingParams(temperature=0.0, max_tokens=3), grammars=[spec])[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 3
    assert output.text.startswith("{")
    with pytest.raises(ValueError):
        json.loads(output.text)  # partial, as OpenAI's


def test_min_tokens_never_keeps_a_complete_grammar_from_ending(llm):
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                    "additionalProperties": False}, param="response_format")
    output = llm.generate([prompt(llm)], SamplingParams(temperature=0.0, min_tokens=30, max_tokens=40),
                          grammars=[spec])[0]
    assert output.finish_reason == "stop" and json.loads(output.text) in ({"ok": True}, {"ok": False})


def test_speculation_steps_aside_for_constrained_requests(model_dir):
    llm = LLM(model_dir, speculative_method="ngram", num_speculative_tokens=3)
    spec = GrammarSpec.json_schema(PERSON, param="response_format")
    repetitive = prompt(llm, "the cat sees the cat sees the cat sees the cat sees")
    free, constrained = llm.generate([repetitive, repetitive], SamplingParams(temperature=0.0, max_tokens=80),
                                     grammars=[None, spec])
    assert constrained.usage.spec_proposed_tokens == 0
    jsonschema.validate(json.loads(constrained.text), PERSON)
    assert free.usage.spec_proposed_tokens > 0  # speculation was on for the others


def test_a_grammar_compiles_once_per_schema(llm):
    compiler = llm.engine.grammars
    schema = {"type": "object", "properties": {"only_here": {"type": "boolean"}}, "required": ["only_here"]}
    misses = compiler.misses
    first = compiler.compile(GrammarSpec.json_schema(schema, param="response_format"))
    again = compiler.compile(GrammarSpec.json_schema(dict(schema), param="response_format"))
    assert first is again and compiler.misses == misses + 1
    state = llm.engine.state()["grammars"]  # /v1/state
    assert state["cached"] >= 1 and state["hits"] >= 1 and state["constrained_sequences"] == 0


@pytest.mark.parametrize("schema, words", [
    ({"type": "nonsense"}, "nonsense"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}, "pattern"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
    ({"type": "string", "format": "no-such-format"}, "format"),
], ids=["invalid-type", "unsupported-lookbehind", "dangling-ref", "unknown-format"])
def test_unusable_schemas_are_refused_naming_the_parameter(llm, schema, words):
    with pytest.raises(GrammarError) as error:
        llm.engine.grammars.compile(GrammarSpec.json_schema(schema, param="response_format.json_schema.schema"))
    assert error.value.param == "response_format.json_schema.schema"
    assert words in str(error.value).lower() or "cannot be used" in str(error.value)


def test_schemas_past_the_size_and_complexity_bounds_are_refused(llm):
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                             for i in range(MAX_GRAMMAR_BYTES // 100)}}
    with pytest.raises(GrammarError, match="too large"):
        llm.engine.grammars.compile(GrammarSpec.json_schema(huge, param="response_format"))
    # the bounds that stop a grammar while it compiles: its size in symbols, the lexer's fuel (a proxy for time,
    # about 50k per ms), and the wall-clock time; set low here to show them on a schema of ordinary size
    schema = {"type": "object", "properties": {f"k{i}": {"enum": [f"v{j}" for j in range(30)]} for i in range(20)}}
    spec = GrammarSpec.json_schema(schema, param="response_format")
    tokenizer_json = llm.engine.grammars.tokenizer_json
    for bound, message in (({"limits": {"max_grammar_size": 100}}, "grammar size"),
                           ({"limits": {"initial_lexer_fuel": 100}}, "too big"),
                           ({"max_compile_seconds": 1e-9}, "too complex")):
        compiler = GrammarCompiler(tokenizer_json, vocab_size=600, eos_token_ids=(2,), **bound)
        with pytest.raises(GrammarError, match=message) as error:
            compiler.compile(spec)
        assert error.value.param == "response_format" and compiler.state()["cached"] == 0
    assert GrammarCompiler(tokenizer_json, vocab_size=600, eos_token_ids=(2,)).compile(spec)


# tool calls

def request(body: dict) -> GenerateRequest:
    return parse_generate(json.dumps({"messages": [{"role": "user", "content": "hi"}], **body}).encode())


def test_each_family_template_picks_its_convention():
    assert isinstance(format_for_template("{% if tools %}<tool_call>{% endif %}"), Hermes)
    assert isinstance(format_for_template("{{ '<|python_tag|>' }}{% if tools %}ipython{% endif %}"), Llama3Json)
    assert isinstance(format_for_template("[AVAILABLE_TOOLS]{{ '[TOOL_CALLS]' }}"), Mistral)
    assert format_for_template("{{ messages }}") is None


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("parallel", [False, True], ids=["one", "parallel"])
def test_required_tool_calls_parse_by_construction(llm, fmt, parallel):
    """Whatever the random model writes under a family's call grammar parses as calls of the given tools."""
    body = {"tools": [{"type": "function", "function": WEATHER}, {"type": "function", "function": CLOCK}],
            "tool_choice": "required", "parallel_tool_calls": parallel}
    structure = plan(request(body), tool_format=fmt, special_id=lambda text: None)
    sampling = [SamplingParams(temperature=1.0, seed=i, max_tokens=160) for i in range(12)]
    outputs = llm.generate([prompt(llm)] * 12, sampling, grammars=[structure.grammar] * 12)
    finished = [o for o in outputs if o.finish_reason == "stop"]  # a random model may call on past max_tokens
    assert len(finished) >= 4
    for output in finished:
        parsed = fmt.parse(output.text, final=True)
        assert parsed.calls and parsed.content == "", output.text
        assert parallel or len(parsed.calls) == 1
        for call in parsed.calls:
            schema = WEATHER if call.name == "get_weather" else CLOCK
            jsonschema.validate(json.loads(call.arguments), schema["parameters"])


def test_a_named_function_is_the_only_one_called(llm):
    body = {"tools": [{"type": "function", "function": WEATHER}, {"type": "function", "function": CLOCK}],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    structure = plan(request(body), tool_format=Hermes(), special_id=lambda text: None)
    outputs = llm.generate([prompt(llm)] * 6, [SamplingParams(temperature=1.0, seed=i, max_tokens=80)
                                               for i in range(6)], grammars=[structure.grammar] * 6)
    assert all({c.name for c in Hermes().parse(o.text, final=True).calls} == {"get_time"} for o in outputs)


def test_auto_with_a_json_format_allows_the_json_or_calls(llm):
    body = {"tools": [{"type": "function", "function": CLOCK}], "tool_choice": "auto",
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
    structure = plan(request(body), tool_format=Hermes(), special_id=lambda text: None)
    assert [g.param for g in structure.grammars] == ["response_format.json_schema.schema", "tools"]
    outputs = llm.generate([prompt(llm)] * 8, [SamplingParams(temperature=1.0, seed=i, max_tokens=80)
                                               for i in range(8)], grammars=[structure.grammar] * 8)
    for output in outputs:
        parsed = Hermes().parse(output.text, final=True)
        if not parsed.calls:
            jsonschema.validate(json.loads(parsed.content), PERSON)


def test_tool_calls_stream_as_openai_streams_them():
    """Content without the markup; each call's id and name as soon as they are written, then its arguments in
    fragments that add up to the whole call's (what the final event and a non-streamed answer carry)."""
    text = 'Let me look.<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>\n' \
           '<tool_call>\n{"name":"get_weather","arguments":{"city":"oslo","days":2}}\n</tool_call>'
    stream, content, calls = ToolCallStream(Hermes()), "", {}
    pushes_with_fragments = 0
    for end in range(1, len(text) + 1):
        piece, deltas = stream.push(text[:end], final=end == len(text))
        assert "<" not in piece
        content += piece
        for delta in deltas:
            if "name" in delta:
                assert delta["index"] not in calls and delta["id"].startswith("call_")
                calls[delta["index"]] = dict(delta)
            else:
                calls[delta["index"]]["arguments"] += delta["arguments"]
        pushes_with_fragments += any("name" not in d for d in deltas)
    assert content == "Let me look."
    whole = Hermes().parse(text, final=True).calls
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(c.name, c.arguments) for c in whole]
    assert [json.loads(c["arguments"]) for c in calls.values()] == [{"zone": "utc"}, {"city": "oslo", "days": 2}]
    assert [c["id"] for c in calls.values()] == [c.id for c in stream.calls]
    assert pushes_with_fragments > 4  # the arguments came in pieces, not at the end


@pytest.mark.parametrize("fmt, text, expected", [
    (Llama3Json(), '<|python_tag|>{"name": "get_time", "parameters": {"zone": "cet"}}; '
                   '{"name": "get_time", "parameters": {"zone": "utc"}}', ["cet", "utc"]),
    (Mistral(), '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "utc"}}]', ["utc"]),
    (Mistral(), '[{"name": "get_time", "arguments": {"zone": "cet"}}]', ["cet"]),  # the marker was special
    (Hermes(), 'It is late.', []),
    (Llama3Json(), 'Plain words {"name": 1}', []),
], ids=["llama3-parallel", "mistral", "mistral-special-marker", "hermes-text", "llama3-text"])
def test_family_parsers(fmt, text, expected):
    parsed = fmt.parse(text, final=True)
    assert [json.loads(c.arguments)["zone"] for c in parsed.calls] == expected
    assert (parsed.content == text) == (not expected)


@pytest.mark.parametrize("body, param", [
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": WEATHER}], "tool_choice": {"type": "function",
                                                                            "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"sampling": {"logit_bias": {"abc": 1}}}, "sampling.logit_bias"),
    ({"sampling": {"logit_bias": {"5": 101}}}, "sampling.logit_bias"),
    ({"sampling": {"logit_bias": [1, 2]}}, "sampling.logit_bias"),
], ids=["empty-tools", "nameless-tool", "unknown-named-function", "choice-without-tools", "nameless-schema",
        "unknown-format", "bias-key", "bias-range", "bias-shape"])
def test_bad_structured_input_is_refused_naming_the_parameter(body, param):
    with pytest.raises(BadRequest) as error:
        request(body)
    assert error.value.param == param


def test_a_model_without_a_tool_convention_refuses_tools():
    with pytest.raises(BadRequest, match="tool-calling convention") as error:
        plan(request({"tools": [{"type": "function", "function": CLOCK}]}), tool_format=None,
             special_id=lambda text: None)
    assert error.value.param == "tools"
    assert plan(GenerateRequest(request_id="r", tenant="t", weight=1.0, api_key_id=None, adapter=None,
                                prompts=(PromptSpec(text="x"),), sampling=SamplingParams(), stream=False, metadata={}),
                tool_format=None, special_id=lambda text: None).grammar is None


def test_a_vocabulary_that_cannot_write_the_grammar_is_refused(checkpoints):
    """The word-level test tokenizer (w6 ... w159, no decoder): llguidance cannot read it, and it could not write
    JSON anyway."""
    compiler = GrammarCompiler(checkpoints["llama"] / "tokenizer.json", vocab_size=160, eos_token_ids=(2,))
    with pytest.raises(GrammarError, match="cannot be used with this model") as error:
        compiler.compile(GrammarSpec.json_schema({"type": "object"}, param="response_format"))
    assert error.value.param == "response_format"


def test_constrained_and_biased_requests_on_the_triton_launchers_match_peft(model_dir, adapter_dirs, oracle,
                                                                            triton_launchers):
    """The GPU path without a GPU: every op on its Triton launcher under Triton's interpreter."""
    llm = LLM(model_dir, max_adapter_rank=8)
    llm.add_adapter("a", adapter_dirs["a"])
    assert kernels.backend_for(llm.engine.memory.layers[0]) == "triton"
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                    "additionalProperties": False}, param="response_format")
    p = prompt(llm)
    first = oracle.greedy(p, None, 1)[0]
    bias = {first: -100.0}
    constrained, biased = llm.generate(
        [p, p], [SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(temperature=0.0, max_tokens=2,
                                                                               logit_bias=bias)],
        adapters=["a", None], grammars=[spec, None])  # fmt: skip
    assert constrained.token_ids == masked_greedy(oracle, llm, p, "a", spec, 12)
    json.loads(constrained.text)
    logits = oracle.logits(p, None)[-1]
    logits[first] -= 100.0
    assert biased.token_ids[0] == int(logits.argmax())
