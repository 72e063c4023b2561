"""End-to-end: `pdserve serve` on the real model in every mode, and the same roles as
separate processes (`pdserve worker` x2 behind `pdserve frontend`), driven by the
official openai SDK and curl, /metrics checked by `promtool check metrics` (Debian's
prometheus package) and parsed by the Prometheus client library, then stopped with
SIGTERM. Run by scripts/test.sh; prints one
summary line.

Usage: python3 tests/e2e/test_openai.py PATH_TO_PDSERVE
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import openai
from prometheus_client.parser import text_string_to_metric_families

PDSERVE = sys.argv[1]
RESULTS = []


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


def start(mode):
    """The server for `mode`: the front process last in the list."""
    port = free_port()
    if mode == "processes":
        ports = [free_port(), free_port()]
        procs = [spawn("worker", "--role", role, "--listen", f"127.0.0.1:{p}")
                 for role, p in zip(("prefill", "decode"), ports)]
        workers = ",".join(f"127.0.0.1:{p}" for p in ports)
        procs.append(spawn("frontend", "--workers", workers, "--mode", "disaggregated", "--port", str(port)))
    else:
        procs = [spawn("serve", "--mode", mode, "--port", str(port))]
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

    for name, fn in [("completion", completion), ("completion_stream", completion_stream), ("chat", chat),
                     ("chat_stream_logprobs", chat_stream_logprobs), ("stop_string", stop_string),
                     ("bad_requests", bad_requests), ("curl", curl_calls), ("metrics_parse", metrics_parse)]:
        check(f"{mode}/{name}", fn)


def main():
    for mode in ("aggregated", "disaggregated", "auto", "processes"):
        procs, url = start(mode)
        try:
            suite(mode, url)
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
    failed = sum(1 for _, e in RESULTS if e)
    print(f"e2e: {len(RESULTS) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
