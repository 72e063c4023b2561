"""LiteLLM (PyPI, pinned) against pdserve through its Anthropic and Responses routes:
`completion` with an `anthropic/` model (LiteLLM speaks /v1/messages), its
`anthropic.messages` pass-through, and `responses` with an `openai/` model, whole and
streamed. Greedy answers equal the chat completion's (one prompt path). Called by
test_openai.py in one mode.
"""
import asyncio
import os

# LiteLLM fetches a price list from GitHub at import unless told to use its own copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm  # noqa: E402
import openai  # noqa: E402

ASK = [{"role": "user", "content": "What is the capital of France?"}]


def suite(mode, url, check):
    model = openai.OpenAI(base_url=url + "/v1", api_key="none").models.list().data[0].id
    chat = openai.OpenAI(base_url=url + "/v1", api_key="none").chat.completions.create(
        model=model, messages=ASK, max_tokens=24, temperature=0).choices[0].message.content
    common = dict(api_key="none", max_retries=0)

    def anthropic_route():
        r = litellm.completion(model="anthropic/" + model, api_base=url, messages=ASK, max_tokens=24, temperature=0,
                               **common)
        assert r.choices[0].message.content == chat, (r.choices[0].message.content, chat)
        assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0, r.usage
        s = litellm.completion(model="anthropic/" + model, api_base=url, messages=ASK, max_tokens=24, temperature=0,
                               stream=True, **common)
        assert "".join(c.choices[0].delta.content or "" for c in s) == chat

    def anthropic_messages():
        async def call():
            return await litellm.anthropic.messages.acreate(model="anthropic/" + model, api_base=url, api_key="none",
                                                            max_tokens=24, messages=ASK, temperature=0)
        r = asyncio.run(call())
        assert r["type"] == "message" and r["content"][0]["text"] == chat, r

    def responses_route():
        r = litellm.responses(model="openai/" + model, api_base=url + "/v1", input=ASK[0]["content"],
                              max_output_tokens=24, temperature=0, **common)
        assert r.output[0].content[0].text == chat and r.usage.output_tokens > 0, r
        events = list(litellm.responses(model="openai/" + model, api_base=url + "/v1", input=ASK[0]["content"],
                                        max_output_tokens=24, temperature=0, stream=True, **common))
        kinds = [str(getattr(e.type, "value", e.type)) for e in events]
        assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete"), kinds
        text = "".join(e.delta for e in events if str(getattr(e.type, "value", e.type)) == "response.output_text.delta")
        assert text == chat, (text, chat)

    for name, fn in [("anthropic_route", anthropic_route), ("anthropic_messages", anthropic_messages),
                     ("responses_route", responses_route)]:
        check(f"{mode}/litellm_{name}", fn)
