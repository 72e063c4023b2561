"""Several models behind one port: `pdserve serve --models-dir DIR` over the default model
and Gemma 3 270M, each with workers of its own, requests going by their `model`; then
`--model default --model gemma3-270m --models-max 1`, where asking for one unloads the other once its requests in flight
have finished. Driven by the openai SDK; called by test_openai.py."""
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request

import openai

PROMPT = "The capital of France is"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(pdserve, *args):
    port = free_port()
    proc = subprocess.Popen([pdserve, "serve", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc, url, log
        except Exception:
            time.sleep(0.1)
        if proc.poll() is not None:
            time.sleep(0.5)
            raise RuntimeError("server exited: " + "".join(log))
    raise RuntimeError("server did not become healthy")


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return "hung"


def engine_threads(proc):
    """The names of the process's engine threads (`pdserve-{worker}`, cut to 15 bytes)."""
    names = []
    for t in os.listdir(f"/proc/{proc.pid}/task"):
        try:
            with open(f"/proc/{proc.pid}/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return [n for n in names if n.startswith("pdserve-")]


def greedy(client, model, max_tokens=8):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0)


def reference(pdserve, model):
    """The model's greedy continuation from `pdserve generate`, one engine, no server."""
    out = subprocess.run([pdserve, "generate", "--model", model, "--prompt", PROMPT, "--max-tokens", "8"],
                         capture_output=True, text=True, timeout=300, check=True)
    return out.stdout


def eventually(what, cond, seconds=60):
    deadline = time.time() + seconds
    while not cond():
        if time.time() > deadline:
            raise AssertionError(f"timed out: {what}")
        time.sleep(0.1)


def run(pdserve, check):
    expected = {"gemma3-270m": reference(pdserve, "gemma3-270m"), "default": reference(pdserve, "default")}
    both_loaded(pdserve, check, expected)
    one_at_a_time(pdserve, check, expected)
    check("models/one_served_name_for_several", lambda: one_served_name_for_several(pdserve))


def pulled(pdserve, name):
    """The cached file of a known model (`pdserve pull` prints its path last)."""
    out = subprocess.run([pdserve, "pull", name], capture_output=True, text=True, timeout=600, check=True)
    return out.stdout.strip().splitlines()[-1]


def models_dir(pdserve):
    """A directory holding both models under their own file names, as links."""
    d = tempfile.mkdtemp()
    for name in ("default", "gemma3-270m"):
        path = pulled(pdserve, name)
        os.symlink(path, os.path.join(d, os.path.basename(path)))
    return d


def one_served_name_for_several(pdserve):
    out = subprocess.run([pdserve, "serve", "--port", "0", "--model", "default", "--model", "gemma3-270m",
                          "--served-model-name", "x"], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "--served-model-name names one model" in out.stderr, out


def both_loaded(pdserve, check, expected):
    # Both from a models directory (sorted by file name: SmolLM2 first).
    proc, url, log = start(pdserve, "--mode", "aggregated", "--models-dir", models_dir(pdserve))
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    names = {}

    def listed():
        ids = [m.id for m in client.models.list().data]
        assert len(ids) == 2, ids
        names["default"], names["gemma3-270m"] = ids
        assert "SmolLM2" in ids[0] and "gemma" in ids[1], ids

    def by_model():
        for spec, name in names.items():
            r = greedy(client, name)
            assert r.model == name, r.model
            assert expected[spec].startswith(r.choices[0].text) and r.choices[0].text, (spec, r.choices[0].text)
        # Each prompt is read by its own model's tokenizer.
        counts = {greedy(client, n).usage.prompt_tokens for n in names.values()}
        assert len(counts) == 2, counts
        # No model named: the first.
        assert greedy(client, None).choices[0].text == greedy(client, names["default"]).choices[0].text

    def unknown_model():
        try:
            greedy(client, "no-such-model")
            raise AssertionError("served an unknown model")
        except openai.NotFoundError as e:
            assert e.body["code"] == "model_not_found", e.body

    def side_by_side():
        out = {}
        threads = [threading.Thread(target=lambda n=n: out.update({n: greedy(client, n, 24).usage.completion_tokens}))
                   for n in names.values()]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert len(out) == 2 and all(n > 0 for n in out.values()), out

    for name, fn in [("listed", listed), ("by_model", by_model), ("unknown_model", unknown_model),
                     ("side_by_side", side_by_side)]:
        check(f"models/{name}", fn)
    rc = stop(proc)
    check("models/sigterm_exit_0", lambda: None if rc == 0 else (_ for _ in ()).throw(AssertionError(f"exit {rc}")))


def one_at_a_time(pdserve, check, expected):
    proc, url, log = start(pdserve, "--mode", "aggregated", "--model", "default", "--model", "gemma3-270m",
                           "--models-max", "1")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    smol, gemma = [m.id for m in client.models.list().data]

    def first_loaded_at_start():
        threads = engine_threads(proc)
        assert any(t.startswith("pdserve-SmolLM") for t in threads), threads
        assert not any(t.startswith("pdserve-gemma") for t in threads), threads

    def in_flight_finishes_then_unloads():
        # A long greedy stream on the loaded model, then a request for the other.
        stream = client.completions.create(model=smol, prompt=PROMPT, max_tokens=160, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = iter(stream)
        first = next(chunks)
        answer = {}
        t = threading.Thread(target=lambda: answer.update(r=greedy(client, gemma)))
        t.start()
        time.sleep(1.0)
        assert not answer, "the other model was served before the stream in flight finished"
        rest = list(chunks)
        usage = rest[-1].usage
        assert usage is not None and usage.completion_tokens == 160, usage
        assert rest[-2].choices[0].finish_reason == "length", rest[-2]
        t.join(timeout=120)
        text = answer["r"].choices[0].text
        assert text and expected["gemma3-270m"].startswith(text), text
        assert first.choices, first
        eventually("the first model's engine threads end", lambda: not any(
            n.startswith("pdserve-SmolLM") for n in engine_threads(proc)))
        assert any(n.startswith("pdserve-gemma") for n in engine_threads(proc)), engine_threads(proc)
        assert any("model unloaded" in line and "SmolLM" in line for line in log), "".join(log[-20:])

    def back_again():
        text = greedy(client, smol).choices[0].text
        assert text and expected["default"].startswith(text), text
        eventually("gemma's engine threads end", lambda: not any(
            n.startswith("pdserve-gemma") for n in engine_threads(proc)))

    for name, fn in [("first_loaded_at_start", first_loaded_at_start),
                     ("in_flight_finishes_then_unloads", in_flight_finishes_then_unloads),
                     ("back_again", back_again)]:
        check(f"models_max/{name}", fn)
    rc = stop(proc)
    check("models_max/sigterm_exit_0", lambda: None if rc == 0 else (_ for _ in ()).throw(AssertionError(f"exit {rc}")))
