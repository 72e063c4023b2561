"""OpenAI's Responses API end to end with the official `openai` SDK: a response, its
stream (the SDK's event types and its stream helper), a conversation carried by
`previous_response_id` (retrieved, listed, deleted), a forced function call and its
output sent back (through the store and in full, with the same answer), structured
output through `responses.parse`, logprobs (`include`, `top_logprobs`) equal to the
chat completion's, and errors raised as the SDK's own exception types.
A greedy response says what the same chat completion says (one prompt path). Then
Codex (npm, its path in $PDSERVE_CODEX) runs one non-interactive prompt against the
server to its end (`codex`, against a server that samples greedily by default).
Called by test_openai.py.
"""
import json
import os
import subprocess
import tempfile

import openai
import pydantic

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                          "required": ["city"], "additionalProperties": False}}
SYSTEM = "You answer in one short sentence."
ASK = "What is the capital of France?"


class City(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=24)


def suite(mode, url, check):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    said = {}

    def respond(**kw):
        return client.responses.create(model=model, temperature=0, **{"max_output_tokens": 24, **kw})

    def chat(messages, **kw):
        return client.chat.completions.create(model=model, temperature=0, messages=messages,
                                              **{"max_tokens": 24, **kw}).choices[0].message.content

    def response():
        r = respond(instructions=SYSTEM, input=ASK)
        assert r.object == "response" and r.status in ("completed", "incomplete") and r.output_text, r
        assert r.output[0].type == "message" and r.output[0].role == "assistant", r
        assert r.usage.output_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, r
        said["text"] = r.output_text
        twin = chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}])
        assert twin == r.output_text, (twin, r.output_text)

    def stream():
        events = list(respond(instructions=SYSTEM, input=ASK, stream=True))
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"], kinds
        assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
        assert [e.sequence_number for e in events] == list(range(len(events))), events
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == said["text"] == events[-1].response.output_text, (text, said["text"])
        with client.responses.stream(model=model, temperature=0, max_output_tokens=24, instructions=SYSTEM,
                                     input=ASK) as s:
            for _ in s:
                pass
            final = s.get_final_response()
        assert final.output_text == said["text"], final

    def conversation():
        first = respond(input="My name is Ada. Say hello to me.")
        second = respond(input="What is my name?", previous_response_id=first.id)
        assert second.previous_response_id == first.id, second
        # The same conversation sent whole as chat turns says the same.
        twin = chat([{"role": "user", "content": "My name is Ada. Say hello to me."},
                     {"role": "assistant", "content": first.output_text},
                     {"role": "user", "content": "What is my name?"}])
        assert twin == second.output_text, (twin, second.output_text)
        assert client.responses.retrieve(second.id).output_text == second.output_text
        items = client.responses.input_items.list(second.id).data
        assert len(items) == 3 and items[1].type == "message" and items[1].role == "assistant", items
        assert client.responses.delete(first.id) is None
        for gone in (lambda: client.responses.retrieve(first.id), lambda: client.responses.delete(first.id)):
            try:
                gone()
                raise AssertionError("a deleted response is still there")
            except openai.NotFoundError:
                pass
        try:
            respond(input="Again?", previous_response_id=first.id)
            raise AssertionError("a deleted previous_response_id accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == "previous_response_id", e.body
        unstored = respond(input="Hi", store=False)
        try:
            client.responses.retrieve(unstored.id)
            raise AssertionError("store=False kept the response")
        except openai.NotFoundError:
            pass

    def function_round_trip():
        ask = "What is the weather in Paris?"
        r = respond(input=ask, tools=[WEATHER], tool_choice="required", max_output_tokens=80)
        calls = [o for o in r.output if o.type == "function_call"]
        assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather", r
        assert isinstance(json.loads(calls[0].arguments)["city"], str), calls[0]
        result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 degrees and sunny"}
        through_store = respond(previous_response_id=r.id, input=[result], tools=[WEATHER], max_output_tokens=30)
        whole = respond(input=[{"role": "user", "content": ask}, calls[0].model_dump(), result], tools=[WEATHER],
                        max_output_tokens=30, store=False)
        assert through_store.output and [o.model_dump() for o in whole.output] != [], whole
        assert through_store.output_text == whole.output_text, (through_store.output, whole.output)

    def streamed_function_call():
        events = list(respond(input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
                              max_output_tokens=80, stream=True))
        done = [e.item for e in events if e.type == "response.output_item.done"]
        assert len(done) == 1 and done[0].type == "function_call" and done[0].name == "get_weather", events
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert args == done[0].arguments and events[-1].type == "response.completed", events

    def structured_output():
        r = client.responses.parse(model=model, temperature=0, max_output_tokens=40, input=ASK, text_format=City)
        assert isinstance(r.output_parsed, City), r

    def logprobs():
        # The chat completion's logprobs for the same prompt are the reference.
        twin = client.chat.completions.create(model=model, temperature=0, max_tokens=24, logprobs=True,
                                              top_logprobs=2, messages=[{"role": "system", "content": SYSTEM},
                                                                        {"role": "user", "content": ASK}])
        want = [(t.token, round(t.logprob, 4), [a.token for a in t.top_logprobs]) for t in twin.choices[0].logprobs.content]
        ask = dict(instructions=SYSTEM, input=ASK, include=["message.output_text.logprobs"], top_logprobs=2)
        r = respond(**ask)
        got = [(t.token, round(t.logprob, 4), [a.token for a in t.top_logprobs]) for t in r.output[0].content[0].logprobs]
        assert got == want and len(got) == r.usage.output_tokens, (got, want)
        events = list(respond(stream=True, **ask))
        streamed = [t.token for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
        done = [e for e in events if e.type == "response.output_text.done"][0]
        assert streamed == [t[0] for t in want] == [t.token for t in done.logprobs], (streamed, want)
        plain = respond(instructions=SYSTEM, input=ASK)
        assert not plain.output[0].content[0].logprobs, plain

    def errors():
        bad = [(dict(model="no-such-model", input="hi"), openai.NotFoundError),
               (dict(model=model, input="hi", max_output_tokens=-1), openai.BadRequestError),
               (dict(model=model, input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
                openai.BadRequestError),
               (dict(model=model, input="hi", text={"format": {"type": "xml"}}), openai.BadRequestError)]
        for kw, kind in bad:
            try:
                client.responses.create(**kw)
                raise AssertionError(f"{kw} accepted")
            except kind as e:
                assert e.body["message"], e.body
        try:
            client.responses.retrieve("resp_nothing")
            raise AssertionError("an unknown response found")
        except openai.NotFoundError:
            pass

    for name, fn in [("response", response), ("stream", stream), ("conversation", conversation),
                     ("function_round_trip", function_round_trip), ("streamed_function_call", streamed_function_call),
                     ("structured_output", structured_output), ("logprobs", logprobs), ("errors", errors)]:
        check(f"{mode}/responses_{name}", fn)


def codex(url, check):
    """Codex runs one prompt against the server at `url`, which samples greedily where a
    request sets no temperature (Codex sends none; sampled at 1 the default model
    rambles to the end of its context)."""
    model = openai.OpenAI(base_url=url + "/v1", api_key="none").models.list().data[0].id

    def run():
        # Codex's own instructions and tools as it sends them, but for its optional
        # sub-agent, goal and web-search tools (docs/usage.md): with those the prompt
        # is past the default model's 8,192-token context.
        home = tempfile.mkdtemp()
        with open(os.path.join(home, "config.toml"), "w") as f:
            f.write(f'model = "{model}"\nmodel_provider = "pdserve"\n[model_providers.pdserve]\n'
                    f'name = "pdserve"\nbase_url = "{url}/v1"\nwire_api = "responses"\n'
                    'request_max_retries = 0\nstream_max_retries = 0\n')
        env = {**os.environ, "HOME": home, "CODEX_HOME": home}
        out = subprocess.run([os.environ["PDSERVE_CODEX"], "exec", "--skip-git-repo-check", "--json",
                              "--disable", "multi_agent", "--disable", "goals", "-c", 'web_search="disabled"',
                              "-s", "read-only", "Say hello in one word."],
                             capture_output=True, text=True, timeout=300, env=env, cwd=home, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
        events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        kinds = [e.get("type") for e in events]
        assert "turn.completed" in kinds and "turn.failed" not in kinds, events
        assert any(e.get("item", {}).get("type") == "agent_message" for e in events), events
        usage = next(e["usage"] for e in events if e.get("type") == "turn.completed")
        # Its instructions and tool definitions are thousands of tokens.
        assert usage["input_tokens"] > 1000 and usage["output_tokens"] > 0, usage

    check("codex/exec", run)
