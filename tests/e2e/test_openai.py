"""End-to-end: `pdserve serve` on the real model in every mode, and the same roles as
separate processes (`pdserve worker` x2 behind `pdserve frontend`), driven by the
official openai SDK and curl (structured outputs and tools: structured.py), the
official anthropic SDK and Claude Code (anthropic_api.py), the Responses API with the
openai SDK and Codex (responses_api.py), LiteLLM's Anthropic and Responses routes
(litellm_routes.py); two models behind one port, loaded together or one at a time
(models.py); /metrics checked by `promtool check metrics` (Debian's prometheus
package) and parsed by the Prometheus client library; then stopped with SIGTERM. Run
by scripts/test.sh; prints one summary line.

Usage: python3 tests/e2e/test_openai.py PATH_TO_PDSERVE
"""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import openai
from prometheus_client.parser import text_string_to_metric_families

import anthropic_api
import litellm_routes
import models
import responses_api
import structured

PDSERVE = sys.argv[1]
RESULTS = []
# Each mode's embedding of the same text, compared across modes.
EMBEDDINGS = {}
# The served names every server answers to (vLLM's --served-model-name).
NAMES = ["--served-model-name", "smol", "--served-model-name", "smol-alias"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check(name, fn):
    try:
        fn()
        RESULTS.append((name, None))
        print(f"ok   {name}", flush=True)
    except Exception as e:  # report every failure, keep going
        RESULTS.append((name, e))
        print(f"FAIL {name}: {e!r}", flush=True)


def curl(*args):
    out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", *args], capture_output=True, text=True, timeout=120)
    body, _, code = out.stdout.rpartition("\n")
    return int(code), body


def spawn(*args):
    return subprocess.Popen([PDSERVE, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def start(mode, *extra):
    """The server for `mode` (with `extra` arguments): the front process last in the list."""
    port = free_port()
    if mode == "processes":
        ports = [free_port(), free_port()]
        token = os.path.join(tempfile.mkdtemp(), "token")
        with open(token, "w") as f:
            f.write(os.urandom(24).hex())
        procs = [spawn("worker", "--role", role, "--listen", f"127.0.0.1:{p}", "--cluster-token-file", token)
                 for role, p in zip(("prefill", "decode"), ports)]
        workers = ",".join(f"127.0.0.1:{p}" for p in ports)
        procs.append(spawn("frontend", "--workers", workers, "--mode", "disaggregated", "--port", str(port), *NAMES,
                           "--cluster-token-file", token))
    else:
        procs = [spawn("serve", "--mode", mode, "--port", str(port), *NAMES, *extra)]
    proc = procs[-1]
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return procs, url
        except Exception:
            time.sleep(0.1)
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read()}")
    raise RuntimeError("server did not become healthy")


def suite(mode, url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    greedy = {}

    def completion():
        r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
        assert r.choices[0].text.startswith(" Paris"), r.choices[0].text
        assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == 5, r.usage
        greedy["completion"] = r.choices[0].text

    def completion_stream():
        chunks = list(client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                                temperature=0, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == greedy["completion"], (text, greedy["completion"])
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8

    def chat():
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                           max_tokens=24, temperature=0, seed=1)
        assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
        assert r.choices[0].finish_reason in ("stop", "length")

    def chat_stream_logprobs():
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to five."}],
                                                max_tokens=16, temperature=0, stream=True, logprobs=True, top_logprobs=3)
        n = 0
        for c in stream:
            if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content:
                for lp in c.choices[0].logprobs.content:
                    assert lp.logprob <= 0 and len(lp.top_logprobs) == 3
                    n += 1
        assert n > 0

    def stop_string():
        r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=16, temperature=0,
                                      stop=["."])
        assert "." not in r.choices[0].text and r.choices[0].finish_reason == "stop", r.choices[0]

    def bad_requests():
        try:
            client.completions.create(model=model, prompt="hi", max_tokens=-1)
            raise AssertionError("negative max_tokens accepted")
        except openai.BadRequestError:
            pass
        try:
            client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
            raise AssertionError("unknown model accepted")
        except openai.NotFoundError:
            pass

    def served_names():
        assert [m.id for m in client.models.list().data] == ["smol", "smol-alias"]
        assert client.models.retrieve("smol-alias").id == "smol-alias"
        r = client.completions.create(model="smol-alias", prompt="Hi", max_tokens=2)
        assert r.model == "smol-alias", r.model

    def n_choices():
        r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0, n=2)
        assert [c.index for c in r.choices] == [0, 1]
        assert all(c.text == greedy["completion"] for c in r.choices), r.choices
        assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 16, r.usage
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a color."}],
                                           max_tokens=8, temperature=1.0, seed=3, n=3)
        assert len(r.choices) == 3 and all(c.message.content for c in r.choices)

    def batched_prompts():
        prompts = ["The capital of France is", "Once upon a time"]
        r = client.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0)
        assert len(r.choices) == 2
        for c, p in zip(sorted(r.choices, key=lambda c: c.index), prompts):
            alone = client.completions.create(model=model, prompt=p, max_tokens=6, temperature=0)
            assert c.text == alone.choices[0].text, (c.text, alone.choices[0].text)

    def echo_logprobs():
        # The logprob of " Paris" when generated equals its score as part of the prompt.
        gen = client.completions.create(model=model, prompt="The capital of France is", max_tokens=1, temperature=0,
                                        logprobs=1)
        token, lp = gen.choices[0].logprobs.tokens[0], gen.choices[0].logprobs.token_logprobs[0]
        text = "The capital of France is" + gen.choices[0].text
        r = client.completions.create(model=model, prompt=text, max_tokens=0, echo=True, logprobs=1, temperature=0)
        c = r.choices[0]
        assert c.text == text, c.text
        assert c.logprobs.token_logprobs[0] is None and c.logprobs.tokens[-1] == token, c.logprobs.tokens
        assert abs(c.logprobs.token_logprobs[-1] - lp) < 1e-6, (c.logprobs.token_logprobs[-1], lp)
        assert all(x <= 0 for x in c.logprobs.token_logprobs[1:])
        # vLLM's prompt_logprobs: the same scores in their own field.
        r = client.completions.create(model=model, prompt=text, max_tokens=1, temperature=0,
                                      extra_body={"prompt_logprobs": 0})
        scores = r.model_dump()["choices"][0]["prompt_logprobs"]
        assert scores[0] is None and len(scores) == len(c.logprobs.tokens), scores
        last = scores[-1]
        assert any(abs(v["logprob"] - lp) < 1e-6 for v in last.values()), last

    def embeddings():
        texts = ["The cat sat on the mat.", "A cat was sitting on a mat.", "Stock prices fell sharply today."]
        r = client.embeddings.create(model=model, input=texts)  # the SDK asks for base64
        v = [d.embedding for d in r.data]
        dot = lambda a, b: sum(x * y for x, y in zip(a, b))  # noqa: E731
        assert [d.index for d in r.data] == [0, 1, 2] and len({len(x) for x in v}) == 1 and len(v[0]) > 0, r
        assert all(abs(dot(x, x) - 1) < 1e-4 for x in v), "unit length"
        assert dot(v[0], v[1]) > dot(v[0], v[2]), "a paraphrase is nearer than another topic"
        assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens, r.usage
        one = client.embeddings.create(model=model, input=texts[0], encoding_format="float").data[0].embedding
        assert max(abs(a - b) for a, b in zip(one, v[0])) < 1e-6, "float and base64 carry the same vector"
        EMBEDDINGS[mode] = one
        if mode == "processes":
            assert all(e == one for e in EMBEDDINGS.values()), "the same embedding in every mode"
        code, body = curl(url + "/v1/embeddings", "-H", "Content-Type: application/json",
                          "-d", json.dumps({"input": texts[0], "pooling": "last"}))
        last = json.loads(body)
        assert code == 200 and last["pooling"] == "last" and dot(last["data"][0]["embedding"], one) < 0.999, body
        for bad in [{"input": ""}, {"input": "x", "dimensions": 8}, {"input": "x", "encoding_format": "int8"}]:
            try:
                client.embeddings.create(model=model, **bad)
                raise AssertionError(f"{bad} accepted")
            except openai.BadRequestError as e:
                assert e.body["param"] in ("input", "dimensions", "encoding_format"), e.body

    def token_ids():
        # vLLM's return_token_ids: the ids are the text's, and sent back as a prompt
        # they continue the same conversation (what bench load --replies generated does).
        prompt = "The capital of France is"
        r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"return_token_ids": True}).model_dump()
        c = r["choices"][0]
        code, body = curl(url + "/detokenize", "-H", "Content-Type: application/json",
                          "-d", json.dumps({"tokens": c["token_ids"]}))
        assert code == 200 and json.loads(body)["prompt"] == c["text"] and len(c["token_ids"]) == 8, (c, body)
        code, body = curl(url + "/tokenize", "-H", "Content-Type: application/json",
                          "-d", json.dumps({"prompt": prompt}))
        assert c["prompt_token_ids"] == json.loads(body)["tokens"], (c, body)
        again = client.completions.create(model=model, prompt=c["prompt_token_ids"] + c["token_ids"], max_tokens=4,
                                          temperature=0)
        assert again.usage.prompt_tokens == len(c["prompt_token_ids"]) + 8, again.usage
        chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=4, temperature=0, stream=True,
                                                     stream_options={"include_usage": True},
                                                     extra_body={"return_token_ids": True}))
        ids = [i for ch in chunks for choice in ch.model_dump()["choices"] for i in (choice.get("token_ids") or [])]
        assert len(ids) == chunks[-1].usage.completion_tokens > 0, (ids, chunks[-1])
        assert chunks[0].model_dump()["prompt_token_ids"], chunks[0]

    def tokenize():
        code, body = curl(url + "/tokenize", "-H", "Content-Type: application/json",
                          "-d", json.dumps({"model": "smol", "prompt": "The capital of France is"}))
        t = json.loads(body)
        assert code == 200 and t["count"] == 5 and len(t["tokens"]) == 5, (code, body)
        code, body = curl(url + "/detokenize", "-H", "Content-Type: application/json",
                          "-d", json.dumps({"tokens": t["tokens"]}))
        assert code == 200 and json.loads(body)["prompt"] == "The capital of France is", body

    def cached_tokens():
        # A repeated prompt reports the prefix-cache tokens its engine reused, and the
        # realized-hit counter moves by exactly that much.
        prompt = "In the beginning the universe was created. " * 8
        realized = lambda: sum(s.value for f in text_string_to_metric_families(curl(url + "/metrics")[1])
                               if f.name == "pdserve_prefix_hit_tokens" for s in f.samples
                               if s.labels.get("kind") == "realized")
        client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
        before = realized()
        r = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert 0 <= cached < r.usage.prompt_tokens and realized() - before == cached, (cached, realized(), before)
        if mode != "auto":  # auto may prefill the repeat on the other worker
            assert cached >= 64, r.usage

    def lm_eval_loglikelihood():
        # lm-eval's local-completions loglikelihood path, offline: a task file written
        # here, pdserve's own tokenizer through /tokenizer_info and /tokenize, and the
        # answers checked against the same sums computed through our API.
        with tempfile.TemporaryDirectory() as tmp:
            rows = [{"question": "The capital of France is", "choices": ["Paris", "Berlin", "Madrid"], "answer": 0},
                    {"question": "Two plus two equals", "choices": ["four", "seven", "ten"], "answer": 0}]
            with open(os.path.join(tmp, "tiny.jsonl"), "w") as f:
                f.write("".join(json.dumps(r) + "\n" for r in rows))
            with open(os.path.join(tmp, "tiny.yaml"), "w") as f:
                f.write(f"task: pdserve_tiny\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                        f"    test: {tmp}/tiny.jsonl\ntest_split: test\noutput_type: multiple_choice\n"
                        "doc_to_text: \"{{question}}\"\ndoc_to_target: \"{{answer}}\"\ndoc_to_choice: \"{{choices}}\"\n"
                        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
            args = (f"model={model},base_url={url}/v1/completions,tokenizer_backend=remote,"
                    "tokenized_requests=True,num_concurrent=1")
            env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
            out = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                                  "--tasks", "pdserve_tiny", "--include_path", tmp, "--output_path", tmp + "/out",
                                  "--log_samples"], capture_output=True, text=True, env=env, timeout=600)
            assert out.returncode == 0, out.stderr[-3000:]
            samples = [os.path.join(d, f) for d, _, fs in os.walk(tmp + "/out") for f in fs if f.startswith("samples")]
            docs = [json.loads(l) for l in open(samples[0])]
        tok = lambda text: json.loads(curl(url + "/tokenize", "-H", "Content-Type: application/json", "-d",
                                           json.dumps({"prompt": text, "add_special_tokens": False}))[1])["tokens"]
        checked = 0
        for d in docs:
            for k, resp in enumerate(d["resps"]):
                gen = d["arguments"][f"gen_args_{k}"]
                ctx, cont = tok(gen["arg_0"]), tok(gen["arg_1"])
                r = client.completions.create(model=model, prompt=ctx + cont, max_tokens=0, echo=True, logprobs=0)
                ours = sum(r.choices[0].logprobs.token_logprobs[-len(cont):])
                assert abs(float(resp[0][0]) - ours) < 1e-3, (d["doc"], k, resp, ours)
                checked += 1
        assert checked == 6, checked

    def curl_calls():
        code, body = curl(url + "/v1/completions", "-H", "Content-Type: application/json",
                          "-d", json.dumps({"prompt": "Hello", "max_tokens": 4}))
        assert code == 200 and json.loads(body)["choices"][0]["text"], (code, body)
        code, body = curl(url + "/v1/completions", "-H", "Content-Type: application/json", "-d", "{not json")
        assert code == 400 and "error" in json.loads(body), (code, body)
        code, body = curl("-N", url + "/v1/chat/completions", "-H", "Content-Type: application/json",
                          "-d", json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}))
        assert code == 200 and body.rstrip().endswith("data: [DONE]"), (code, body)
        code, body = curl(url + "/metrics")
        assert code == 200 and "pdserve_requests_total" in body, code

    def metrics_parse():
        code, body = curl(url + "/metrics")
        # promtool is Prometheus's own checker: the text format and its lint rules.
        lint = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, text=True)
        assert lint.returncode == 0 and not lint.stdout.strip() and not lint.stderr.strip(), (lint.stdout, lint.stderr)
        families = {f.name: f for f in text_string_to_metric_families(body)}
        for name in ("pdserve_requests", "pdserve_request_ttft_seconds", "pdserve_phase_seconds", "pdserve_kv_blocks"):
            assert name in families, (name, sorted(families))
        phases = {s.labels.get("phase") for s in families["pdserve_phase_seconds"].samples}
        assert "decode" in phases, phases
        if mode in ("disaggregated", "processes"):
            assert {"queue_prefill", "prefill", "kv_transfer", "queue_decode"} <= phases, phases
        # vLLM's first counters: prompt and generated tokens by model and worker.
        # One series per model, labelled with its first name whatever alias was asked for.
        model = client.models.list().data[0].id
        for name in ("pdserve_prompt_tokens", "pdserve_generation_tokens"):
            samples = [s for s in families[name].samples if s.name.endswith("_total")]
            assert samples and all(s.labels["model"] == model and s.labels["worker"] for s in samples), samples
            assert sum(s.value for s in samples) > 0, samples
        if mode in ("disaggregated", "processes"):
            prefilled = {s.labels["worker"] for s in families["pdserve_prompt_tokens"].samples if s.value > 0}
            decoded = {s.labels["worker"] for s in families["pdserve_generation_tokens"].samples if s.value > 0}
            assert prefilled != decoded, (prefilled, decoded)

    for name, fn in [("completion", completion), ("completion_stream", completion_stream), ("chat", chat),
                     ("chat_stream_logprobs", chat_stream_logprobs), ("stop_string", stop_string),
                     ("bad_requests", bad_requests), ("curl", curl_calls), ("metrics_parse", metrics_parse),
                     ("served_names", served_names), ("n_choices", n_choices), ("batched_prompts", batched_prompts),
                     ("echo_logprobs", echo_logprobs), ("tokenize", tokenize), ("cached_tokens", cached_tokens),
                     ("token_ids", token_ids), ("embeddings", embeddings)]:
        check(f"{mode}/{name}", fn)
    structured.suite(mode, url, check, curl)
    anthropic_api.suite(mode, url, check)
    responses_api.suite(mode, url, check)
    if mode == "aggregated":
        litellm_routes.suite(mode, url, check)
    # lm-eval takes a few seconds to start: once in one process, once across processes.
    for name, fn in [("lm_eval_loglikelihood", lm_eval_loglikelihood)] if mode in ("aggregated", "processes") else []:
        check(f"{mode}/{name}", fn)


def greedy_default_suite(url):
    """A server started with --override-generation-config: requests that set no
    temperature are sampled greedily, with a repetition penalty; Claude Code and Codex, which set none, run
    against it."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    model = client.models.list().data[0].id

    def defaults_apply():
        ask = dict(model=model, max_tokens=24, messages=[{"role": "user", "content": "Tell me a story."}])
        greedy = client.chat.completions.create(temperature=0, **ask).choices[0].message.content
        for _ in range(3):
            assert client.chat.completions.create(**ask).choices[0].message.content == greedy
        sampled = {client.chat.completions.create(temperature=1.5, seed=s, **ask).choices[0].message.content
                   for s in range(4)}
        assert len(sampled) > 1, sampled

    check("greedy_default/defaults_apply", defaults_apply)
    anthropic_api.claude_code(url, check)
    responses_api.codex(url, check)


def main():
    servers = [(mode, (mode,), suite) for mode in ("aggregated", "disaggregated", "auto", "processes")]
    # ollama's default repetition penalty as well: greedy alone, the default model now and
    # then loops ("hello, hello, ...") to its context's end on Claude Code's prompt, whose
    # working directory and date change from run to run (docs/decisions, Claude Code).
    greedy = ("disaggregated", "--override-generation-config", '{"temperature": 0, "repetition_penalty": 1.1}')
    servers.append(("greedy_default", greedy, lambda _, url: greedy_default_suite(url)))
    for mode, args, tests in servers:
        procs, url = start(*args)
        try:
            tests(mode, url)
        finally:
            # The front process first (it drains), then any workers behind it.
            rc = None
            for proc in reversed(procs):
                proc.send_signal(signal.SIGTERM)
                try:
                    code = proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    code = "hung"
                rc = code if rc is None else rc
            check(f"{mode}/sigterm_exit_0", lambda: (_ for _ in ()).throw(AssertionError(f"exit {rc}")) if rc != 0 else None)
    check("models/run", lambda: models.run(PDSERVE, check))
    failed = sum(1 for _, e in RESULTS if e)
    print(f"e2e: {len(RESULTS) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
