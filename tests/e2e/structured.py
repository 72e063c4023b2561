"""Structured outputs and tool calling end to end, with the official openai SDK (and
LangChain against one server): every constrained output parses and validates against
its schema (checked by the `jsonschema` package), tool calls are valid calls, the same
greedy constrained request gives the same text in every serving mode, and each invalid
form is a 400 that leaves the server up. Called by test_openai.py for each mode.
"""
import concurrent.futures
import json
import time

import jsonschema
import openai
import pydantic

# Greedy outputs of the same constrained requests, by mode, compared across modes.
GREEDY = {}


def obj(props, required=None, **extra):
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **extra}


# Bounded, as a schema for a small model should be: an unbounded number or string
# can run on to max_tokens (one digit after another is always valid).
STR = {"type": "string", "maxLength": 24}
INT = {"type": "integer", "minimum": -1000, "maximum": 100000}
NUM = {"type": "number", "minimum": -1000, "maximum": 1000}
SCHEMAS = [
    obj({"name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"city": STR, "country": STR, "population": INT}),
    obj({"title": STR, "tags": {"type": "array", "items": STR, "maxItems": 3}}),
    obj({"answer": {"enum": ["yes", "no", "maybe"]}, "confidence": NUM}),
    obj({"color": {"type": "string", "enum": ["red", "green", "blue"]}, "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    obj({"user": {"$ref": "#/$defs/user"}, "admin": {"type": "boolean"}},
        **{"$defs": {"user": obj({"id": INT, "handle": STR})}}),
    obj({"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3}},
        **{"$defs": {"item": obj({"sku": STR, "qty": {"type": "integer", "minimum": 1, "maximum": 99}})}}),
    obj({"value": {"anyOf": [INT, STR]}}),
    obj({"point": obj({"x": NUM, "y": NUM})}),
    obj({"name": STR, "nickname": STR}, required=["name"]),
    obj({"date": {"type": "string", "format": "date"}, "event": STR}),
    obj({"email": {"type": "string", "format": "email", "maxLength": 40}}),
    obj({"id": {"type": "string", "format": "uuid"}}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": INT, "maxItems": 3},
                    "maxItems": 3}}),
    obj({"status": {"const": "ok"}, "code": INT}),
    obj({"shape": {"anyOf": [obj({"kind": {"const": "circle"}, "r": NUM}),
                             obj({"kind": {"const": "square"}, "side": NUM})]}}),
    {"type": "array", "items": STR, "minItems": 2, "maxItems": 4},
    obj({"steps": {"type": "array", "items": obj({"n": INT, "text": STR}), "maxItems": 3}}),
    obj({"ok": {"type": "boolean"}, "reason": {"anyOf": [STR, {"type": "null"}]}}),
    obj({"person": {"$ref": "#/$defs/person"}},
        **{"$defs": {"person": obj({"name": STR, "friend": {"anyOf": [{"$ref": "#/$defs/leaf"}, {"type": "null"}]}}),
                     "leaf": obj({"name": STR})}}),
]
PROMPTS = ["Answer in JSON.", "Describe something from your day as JSON.", "Give an example record."]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": obj({"city": STR, "unit": {"enum": ["celsius", "fahrenheit"]}}, required=["city"])}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": obj({"zone": STR})}}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    age: int
    hobbies: list[str] = pydantic.Field(max_length=3)


def suite(mode, url, check, curl):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    model = client.models.list().data[0].id

    def chat(messages, **kw):
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return client.chat.completions.create(model=model, messages=messages, temperature=0,
                                              **{"max_tokens": 400, **kw})

    def constrained(schema, prompt):
        fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
        return chat(prompt, response_format=fmt).choices[0]

    def schemas_validate():
        # Twenty schemas times three prompts in one mode; a few in the others.
        cases = [(s, p) for s in SCHEMAS for p in PROMPTS] if mode == "aggregated" else \
            [(SCHEMAS[i], PROMPTS[0]) for i in (0, 5, 15)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda c: constrained(*c), cases))
        for (schema, prompt), out in zip(cases, outs):
            assert out.finish_reason == "stop", (schema, prompt, out)
            value = json.loads(out.message.content)
            jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
        GREEDY.setdefault("schema", {})[mode] = [o.message.content for o in outs[:1]]

    def json_object():
        out = chat("Describe a cat as JSON.", response_format={"type": "json_object"}).choices[0]
        assert isinstance(json.loads(out.message.content), dict), out

    def sdk_parse():
        r = client.chat.completions.parse(model=model, temperature=0, max_tokens=300, response_format=Person,
                                          messages=[{"role": "user", "content": "Invent a person."}])
        person = r.choices[0].message.parsed
        assert isinstance(person, Person) and len(person.hobbies) <= 3, r

    def vllm_extensions():
        r = chat("Is the sky blue?", extra_body={"guided_choice": ["yes", "no"]})
        assert r.choices[0].message.content in ("yes", "no"), r
        r = chat("A phone number:", extra_body={"guided_regex": r"\d{3}-\d{4}"})
        assert len(r.choices[0].message.content) == 8 and r.choices[0].message.content[3] == "-", r
        r = chat("Pick a color.", extra_body={"structured_outputs": {"choice": ["red", "green"]}})
        assert r.choices[0].message.content in ("red", "green"), r
        r = chat("Say hi.", extra_body={"guided_grammar": 'start: "hi" | "hello"'})
        assert r.choices[0].message.content in ("hi", "hello"), r
        r = client.completions.create(model=model, prompt="Numbers:", max_tokens=20, temperature=0,
                                      extra_body={"guided_json": {"type": "array", "items": INT,
                                                                  "maxItems": 3}})
        assert all(isinstance(x, int) for x in json.loads(r.choices[0].text)), r

    def tools_required_and_named():
        prompts = ["What is the weather in Paris?", "Time in Tokyo?", "Hello!"]
        for prompt in prompts:
            for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
                m = chat(prompt, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False).choices[0]
                assert m.finish_reason == "tool_calls" and len(m.message.tool_calls) == 1, m
                call = m.message.tool_calls[0]
                tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
                if isinstance(choice, dict):
                    assert call.function.name == "get_time", call
                jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
                assert call.id and call.type == "function"
        # Parallel calls asked for: one or more, each valid.
        m = chat("Weather in Paris and Oslo?", tools=[WEATHER], tool_choice="required",
                 parallel_tool_calls=True).choices[0]
        assert m.finish_reason == "tool_calls" and 1 <= len(m.message.tool_calls) <= 8, m
        GREEDY.setdefault("tools", {})[mode] = [(c.function.name, c.function.arguments) for c in m.message.tool_calls]

    def tools_within_a_budget():
        # A forced call ends when it is complete: one call, inside a small max_tokens.
        r = chat("What is the weather in Paris?", tools=[WEATHER], tool_choice="required", max_tokens=60)
        m = r.choices[0]
        assert m.finish_reason == "tool_calls" and len(m.message.tool_calls) == 1, r
        assert r.usage.completion_tokens < 60, r
        # Parallel calls cut by max_tokens: the complete ones come back as calls.
        r = chat("Weather in Paris, Oslo, Rome, Lima, Cairo and Tokyo?", tools=[WEATHER], tool_choice="required",
                 parallel_tool_calls=True, max_tokens=60)
        m = r.choices[0]
        assert m.finish_reason == "tool_calls" and m.message.tool_calls and m.message.content is None, r
        for call in m.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    def tools_auto_both_ways():
        # Prose when nothing calls for a tool.
        m = chat("Tell me a short joke.", tools=[WEATHER], max_tokens=40).choices[0]
        assert m.message.tool_calls is None and m.message.content and m.finish_reason in ("stop", "length"), m
        # A call when the conversation shows how (two earlier calls and their results).
        history = []
        for i, city in enumerate(["Paris", "Berlin"]):
            history += [{"role": "user", "content": f"Weather in {city}?"},
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"id": f"c{i}", "type": "function",
                             "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
                        {"role": "tool", "tool_call_id": f"c{i}", "content": "sunny, 21 degrees"},
                        {"role": "assistant", "content": f"It is sunny in {city}."}]
        m = chat(history + [{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER], max_tokens=60).choices[0]
        assert m.finish_reason == "tool_calls", m
        assert json.loads(m.message.tool_calls[0].function.arguments)["city"] == "Oslo", m

    def tool_round_trip():
        messages = [{"role": "user", "content": "What is the weather in Rome?"}]
        m = chat(messages, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).choices[0].message
        call = m.tool_calls[0]
        messages += [m.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 degrees"}]
        final = chat(messages, tools=[WEATHER], tool_choice="none", max_tokens=40).choices[0]
        assert final.message.content and not final.message.tool_calls, final

    def streamed_tool_calls():
        whole = chat("Weather in Paris?", tools=[WEATHER], tool_choice="required").choices[0].message.tool_calls
        stream = chat("Weather in Paris?", tools=[WEATHER], tool_choice="required", stream=True)
        calls, finish = {}, None
        for chunk in stream:
            for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                c = calls.setdefault(d.index, {"name": "", "arguments": ""})
                c["name"] += d.function.name or ""
                c["arguments"] += d.function.arguments or ""
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        assert finish == "tool_calls", finish
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
            [(c.function.name, c.function.arguments) for c in whole]

    def logit_bias():
        base = client.completions.create(model=model, prompt="The capital of France is", max_tokens=1, temperature=0)
        tok = client.completions.create(model=model, prompt="The capital of France is", max_tokens=1, temperature=0,
                                        logprobs=1)
        assert base.choices[0].text == tok.choices[0].text
        ids = json.loads(curl(url + "/tokenize", "-H", "Content-Type: application/json",
                              "-d", json.dumps({"prompt": base.choices[0].text}))[1])["tokens"]
        r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=1, temperature=0,
                                      logit_bias={str(ids[0]): -100})
        assert r.choices[0].text != base.choices[0].text, r

    def bad_inputs():
        bad = [
            {"response_format": {"type": "xml"}},
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{nope"}}},
            {"tools": "notalist"},
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "missing"}}},
            {"tool_choice": "required"},
            {"logit_bias": {"x": 1}},
            {"logit_bias": {"1": 500}},
            {"guided_regex": "(unclosed"},
            {"guided_choice": "notalist"},
        ]
        for extra in bad:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
            code, text = curl(url + "/v1/chat/completions", "-H", "Content-Type: application/json",
                              "-d", json.dumps(body))
            err = json.loads(text)["error"]
            assert code == 400 and err["type"] == "invalid_request_error" and err["message"], (extra, code, text)
        # Unknown extra fields stay accepted, and the server is still up.
        code, _ = curl(url + "/v1/chat/completions", "-H", "Content-Type: application/json", "-d",
                       json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "frob": 1}))
        assert code == 200, code

    def metrics_recorded():
        # Workers report their mask times with their stats, about once a second.
        for _ in range(50):
            body = curl(url + "/metrics")[1]
            samples = dict(line.rsplit(" ", 1) for line in body.splitlines() if line and not line.startswith("#"))
            masks = sum(float(v) for k, v in samples.items() if k.startswith("pdserve_grammar_masks_total"))
            secs = sum(float(v) for k, v in samples.items() if k.startswith("pdserve_grammar_mask_seconds_total"))
            if masks > 0:
                break
            time.sleep(0.1)
        assert masks > 0 and secs > 0, (masks, secs)
        assert float(samples['pdserve_constrained_requests_total{field="response_format"}']) > 0
        assert float(samples['pdserve_constrained_requests_total{field="tools"}']) > 0

    def same_in_every_mode():
        for key in ("schema", "tools"):
            seen = GREEDY.get(key, {})
            assert len(set(json.dumps(v) for v in seen.values())) == 1, (key, seen)

    def langchain():
        from langchain_openai import ChatOpenAI
        llm = ChatOpenAI(base_url=url + "/v1", api_key="none", model=model, temperature=0, max_tokens=200)
        person = llm.with_structured_output(Person).invoke("Invent a person.")
        assert isinstance(person, Person), person
        msg = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Lima?")
        assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather", msg
        assert isinstance(msg.tool_calls[0]["args"]["city"], str), msg
        # Forced at a small budget (LangChain's "any"), the call still comes back as a call.
        short = ChatOpenAI(base_url=url + "/v1", api_key="none", model=model, temperature=0, max_tokens=60)
        msg = short.bind_tools([WEATHER], tool_choice="any").invoke("Weather in Lima?")
        assert len(msg.tool_calls) == 1 and msg.tool_calls[0]["name"] == "get_weather", msg

    tests = [("schemas_validate", schemas_validate), ("json_object", json_object), ("sdk_parse", sdk_parse),
             ("vllm_extensions", vllm_extensions), ("tools_required_and_named", tools_required_and_named),
             ("tools_within_a_budget", tools_within_a_budget),
             ("tools_auto_both_ways", tools_auto_both_ways), ("tool_round_trip", tool_round_trip),
             ("streamed_tool_calls", streamed_tool_calls), ("logit_bias", logit_bias), ("bad_inputs", bad_inputs),
             ("metrics_recorded", metrics_recorded)]
    if mode == "aggregated":
        tests.append(("langchain", langchain))
    if mode == "processes":
        tests.append(("same_in_every_mode", same_in_every_mode))
    for name, fn in tests:
        check(f"{mode}/structured/{name}", fn)
