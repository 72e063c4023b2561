#!/usr/bin/env python3
"""Renders the chat templates of the supported model families the way Hugging Face
transformers' `apply_chat_template` does (Python jinja2 in a sandbox, trim_blocks and
lstrip_blocks, loop controls, a `tojson` over json.dumps without ASCII escaping,
`raise_exception`, `strftime_now`), for a set of conversations, and writes what they
render to OUT/chat.json: the oracle crates/engine/tests/chat_templates.rs checks
pdserve's minijinja rendering against, byte for byte.

The templates are the models' own, as llama.cpp keeps them under models/templates
(Qwen3, Phi-3.5, Llama 3.1/3.2, Mistral Nemo, Gemma 2, whose turns Gemma 3 keeps; the
Gemma 3 270M file is the base model and has none), copied from the vendored sources
into OUT/templates.

Usage: chat_oracle.py LLAMA_CPP_DIR OUT   (needs jinja2)
"""
import json
import pathlib
import shutil
import sys
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# template file, bos, eos
TEMPLATES = {
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", "", "<|im_end|>"),
    "phi3.5": ("microsoft-Phi-3.5-mini-instruct.jinja", "<s>", "<|endoftext|>"),
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    "llama3.2": ("meta-llama-Llama-3.2-3B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "<s>", "</s>"),
    "gemma": ("google-gemma-2-2b-it.jinja", "<bos>", "<eos>"),
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]

SIMPLE = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]
TURNS = [
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello. What can I do?"},
    {"role": "user", "content": "Count to three, é ü 漢."},
]
THOUGHT = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\n4"},
    {"role": "user", "content": "And 3+3?"},
]
TOOLS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": CALL},
    {"role": "tool", "content": "{\"temp\": 21}"},
]

# (template, messages, tools, add_generation_prompt, extra variables)
CASES = [
    ("qwen3", SIMPLE, None, True, {}),
    ("qwen3", SIMPLE, None, True, {"enable_thinking": False}),
    ("qwen3", THOUGHT, None, True, {}),
    ("qwen3", TOOLS, [WEATHER], True, {}),
    ("qwen3", TURNS, None, False, {}),
    ("phi3.5", SIMPLE, None, True, {}),
    ("phi3.5", TURNS, None, True, {}),
    ("llama3.1", SIMPLE, None, True, {"date_string": "02 Dec 2026"}),
    ("llama3.1", TURNS, None, True, {"date_string": "02 Dec 2026"}),
    ("llama3.1", [SIMPLE[1]], [WEATHER], True, {"date_string": "02 Dec 2026"}),
    ("llama3.2", SIMPLE, None, True, {"date_string": "02 Dec 2026"}),
    ("mistral-nemo", TURNS, None, True, {}),
    ("gemma", TURNS, None, True, {}),
    ("gemma", [SIMPLE[1]], None, False, {}),
]


def environment():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def main():
    llama_cpp, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    (out / "templates").mkdir(parents=True, exist_ok=True)
    for file, _, _ in TEMPLATES.values():
        shutil.copy(llama_cpp / "models" / "templates" / file, out / "templates" / file)
    env = environment()
    cases = []
    for name, messages, tools, gen, extra in CASES:
        file, bos, eos = TEMPLATES[name]
        text = (out / "templates" / file).read_text()
        # transformers drops one final newline of the template, as minijinja's
        # keep_trailing_newline(false) does.
        template = env.from_string(text)
        rendered = template.render(messages=messages, tools=tools, add_generation_prompt=gen,
                                   bos_token=bos, eos_token=eos, **extra)
        cases.append({"family": name, "template": file, "bos": bos, "eos": eos, "messages": messages,
                      "tools": tools, "add_generation_prompt": gen, "extra": extra, "expected": rendered})
    (out / "chat.json").write_text(json.dumps(cases, ensure_ascii=False, indent=1))


if __name__ == "__main__":
    main()
