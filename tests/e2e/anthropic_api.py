"""Anthropic's Messages API end to end with the official `anthropic` SDK: a message,
its stream, a forced tool call and the tool result sent back, token counting, and
errors raised as the SDK's own exception types. A greedy message says what the same
chat completion says (one prompt path). Then Claude Code (npm, its path in
$PDSERVE_CLAUDE) runs one non-interactive prompt against the server to its end
(`claude_code`, against a server that samples greedily by default). Called by
test_openai.py.
"""
import json
import os
import subprocess
import tempfile

import anthropic
import openai

WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                            "required": ["city"], "additionalProperties": False}}
SYSTEM = "You answer in one short sentence."
ASK = [{"role": "user", "content": "What is the capital of France?"}]
# The SDK no longer has sampling parameters; the server still takes them, as the API
# took them before (greedy makes a message comparable with its chat twin).
GREEDY = {"temperature": 0}


def suite(mode, url, check):
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    chat = openai.OpenAI(base_url=url + "/v1", api_key="none")
    model = chat.models.list().data[0].id
    said = {}

    def message():
        r = client.messages.create(model=model, max_tokens=24, extra_body=GREEDY, system=SYSTEM, messages=ASK)
        assert r.type == "message" and r.role == "assistant" and r.content[0].type == "text", r
        assert r.stop_reason in ("end_turn", "max_tokens") and r.usage.output_tokens > 0, r
        said["text"], said["input"] = r.content[0].text, r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)
        twin = chat.chat.completions.create(model=model, max_tokens=24, temperature=0,
                                            messages=[{"role": "system", "content": SYSTEM}, *ASK])
        assert twin.choices[0].message.content == r.content[0].text, (twin.choices[0].message.content, r.content)

    def stream():
        with client.messages.stream(model=model, max_tokens=24, extra_body=GREEDY, system=SYSTEM, messages=ASK) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        assert text == said["text"] and final.content[0].text == text, (text, said["text"])
        assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0, final

    def tool_round_trip():
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        r = client.messages.create(model=model, max_tokens=80, extra_body=GREEDY, messages=ask, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"})
        calls = [b for b in r.content if b.type == "tool_use"]
        assert r.stop_reason == "tool_use" and len(calls) >= 1, r
        assert calls[0].name == "get_weather" and isinstance(calls[0].input.get("city"), str), calls[0]
        back = ask + [{"role": "assistant", "content": r.content},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                                    "content": "18 degrees and sunny"}]}]
        r2 = client.messages.create(model=model, max_tokens=24, extra_body=GREEDY, messages=back, tools=[WEATHER])
        assert r2.content and r2.stop_reason in ("end_turn", "max_tokens", "tool_use"), r2

    def streamed_tool_call():
        with client.messages.stream(model=model, max_tokens=80, extra_body=GREEDY, tools=[WEATHER],
                                    tool_choice={"type": "tool", "name": "get_weather"},
                                    messages=[{"role": "user", "content": "Weather in Oslo?"}]) as s:
            final = s.get_final_message()
        calls = [b for b in final.content if b.type == "tool_use"]
        assert final.stop_reason == "tool_use" and calls and isinstance(calls[0].input.get("city"), str), final

    def structured_output():
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"],
                  "additionalProperties": False}
        r = client.messages.create(model=model, max_tokens=40, extra_body=GREEDY, messages=ASK,
                                   output_config={"format": {"type": "json_schema", "schema": schema}})
        value = json.loads(r.content[0].text)
        assert set(value) == {"city"} and isinstance(value["city"], str), value

    def count_tokens():
        n = client.messages.count_tokens(model=model, system=SYSTEM, messages=ASK)
        assert n.input_tokens == said["input"], (n, said["input"])

    def errors():
        for bad, kind in [(dict(model="no-such-model", max_tokens=4), anthropic.NotFoundError),
                          (dict(model=model, max_tokens=-1), anthropic.BadRequestError)]:
            try:
                client.messages.create(messages=ASK, **bad)
                raise AssertionError(f"{bad} accepted")
            except kind as e:
                assert e.body["type"] == "error" and e.body["error"]["message"], e.body

    for name, fn in [("message", message), ("stream", stream), ("tool_round_trip", tool_round_trip),
                     ("streamed_tool_call", streamed_tool_call), ("count_tokens", count_tokens), ("errors", errors),
                     ("structured_output", structured_output)]:
        check(f"{mode}/anthropic_{name}", fn)


def claude_code(url, check):
    """Claude Code runs one prompt against the server at `url`, which samples greedily
    where a request sets no temperature (Claude Code sends none; sampled at 1 the
    default model may ramble to the end of its context, and Claude Code then asks to
    continue past it)."""
    model = openai.OpenAI(base_url=url + "/v1", api_key="none").models.list().data[0].id

    def run():
        # --bare: Claude Code's own tool definitions alone are ~22k tokens, past the
        # default model's 8,192-token context (docs/usage.md); the rest of its exchange
        # (a titling request with a JSON-schema output_config, then the streamed
        # answer, with its system prompt, max_tokens 32000, thinking) is the real one.
        home = tempfile.mkdtemp()
        env = {**os.environ, "HOME": home, "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "none"}
        out = subprocess.run([os.environ["PDSERVE_CLAUDE"], "-p", "Say hello in one word.", "--model", model,
                              "--bare", "--output-format", "json"], capture_output=True, text=True, timeout=300,
                             env=env, cwd=home)
        assert out.returncode == 0, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
        result = json.loads(out.stdout)
        assert not result["is_error"] and result["num_turns"] >= 1, result
        assert result["usage"]["input_tokens"] > 0 and result["usage"]["output_tokens"] > 0, result

    check("claude_code/print", run)
