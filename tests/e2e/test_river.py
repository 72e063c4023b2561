"""NimsForest ingress end to end, with nats-py playing the forest: a real nats-server
with JetStream, one `pdserve worker` and `pdserve frontend --nats URL --river`.

The forest creates its River stream as NimsForest does, publishes RiverData as an
`http_webhook` Source would (and a bare request with the `nimsforest` object),
listens on the reply subjects and on `infer.request.>`, validates every Leaf by
NimsForest's rules, and checks the answer equals the HTTP API's for the same greedy
request. Bad input is rejected with a Leaf and never redelivered (a schema whose
$ref chain is 1,000 deep too: one rejection, one delivery, the frontend still
serving); a request whose deadline passed is rejected, not run; a request published
twice is answered once.
Leaves on the Wind (`infer.request.submit`, as a NATS request and as a plain
publish) are answered the same way; a request that asks for `stream` sends its
tokens as Leaves on `infer.stream.<request_id>` that add up to the answer. Last, 1000 River requests with a second
frontend running and the first killed (-9) mid-run: every one answered exactly once.

Usage: python3 tests/e2e/test_river.py PATH_TO_PDSERVE PATH_TO_NATS_SERVER
"""
import asyncio
import base64
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import nats
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

PDSERVE, NATS_SERVER = sys.argv[1], sys.argv[2]
RESULTS = []
TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z$")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_leaf(msg):
    """NimsForest's Leaf.Validate, plus our own promise: UTC with fractional seconds."""
    leaf = json.loads(msg.data)
    assert set(leaf) == {"subject", "data", "source", "ts"}, leaf
    assert leaf["subject"] == msg.subject, (leaf["subject"], msg.subject)
    assert leaf["source"] and TS.match(leaf["ts"]), leaf
    return leaf


def river_data(payload):
    data = base64.b64encode(json.dumps(payload).encode()).decode()
    ts = datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")
    return json.dumps({"subject": "river.infer.requests", "data": data, "ts": ts}).encode()


def http_answer(url, path, body):
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


async def main():
    tmp = tempfile.mkdtemp()
    nats_port, http_port = free_port(), free_port()
    url = f"nats://127.0.0.1:{nats_port}"
    procs = [subprocess.Popen([NATS_SERVER, "-js", "-sd", tmp, "-p", str(nats_port), "-a", "127.0.0.1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    time.sleep(0.5)
    nc = await nats.connect(url)
    js = nc.jetstream()
    # The forest's own River, made first as NimsForest makes it.
    await js.add_stream(StreamConfig(name="RIVER", subjects=["river.>"], storage=StorageType.FILE,
                                     retention=RetentionPolicy.WORK_QUEUE, max_age=24 * 3600, max_msgs=100_000,
                                     discard=DiscardPolicy.OLD))
    token = os.path.join(tmp, "token")
    with open(token, "w") as f:
        f.write(os.urandom(24).hex())
    procs.append(subprocess.Popen([PDSERVE, "worker", "--role", "mixed", "--listen", "127.0.0.1:0", "--nats", url,
                                   "--cluster-token-file", token], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    def frontend(port):
        return subprocess.Popen([PDSERVE, "frontend", "--nats", url, "--river", "--mode", "aggregated",
                                 "--port", str(port), "--cluster-token-file", token,
                                 "--river-reply-prefix", "infer.result.,forest.replies."],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    procs.append(frontend(http_port))
    api = f"http://127.0.0.1:{http_port}"
    for _ in range(600):
        try:
            # Up once it serves a completion (its worker joined through NATS).
            http_answer(api, "/v1/completions", {"prompt": "x", "max_tokens": 1})
            break
        except Exception:
            await asyncio.sleep(0.1)
    leaves = {}  # subject -> [leaf]

    async def collect(msg):
        if msg.subject == "infer.request.submit":
            return  # the forest's own requests, some invalid on purpose
        try:
            leaf = check_leaf(msg)
        except AssertionError as e:
            leaf = {"invalid": str(e)}
        leaves.setdefault(msg.subject, []).append(leaf)

    await nc.subscribe("infer.>", cb=collect)
    await nc.subscribe("forest.replies.>", cb=collect)

    async def wait_for(subject, n=1, timeout=60):
        t = time.time()
        while len(leaves.get(subject, [])) < n:
            assert time.time() - t < timeout, f"no Leaf on {subject}; have {sorted(leaves)}"
            await asyncio.sleep(0.05)
        return leaves[subject]

    async def check(name, coro):
        try:
            await coro
            RESULTS.append((name, None))
            print(f"ok   river/{name}", flush=True)
        except Exception as e:
            RESULTS.append((name, e))
            print(f"FAIL river/{name}: {e!r}", flush=True)

    chat = {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 12, "temperature": 0}

    async def webhook_round_trip():
        hook = {"headers": {"X-Request-Id": "hook-1", "X-Reply-To": "forest.replies.hook-1"}, "body": chat,
                "timestamp": "2026-01-15T12:00:00Z", "source": "infer-api"}
        await js.publish("river.infer.requests", river_data(hook))
        [result] = await wait_for("forest.replies.hook-1")
        want = http_answer(api, "/v1/chat/completions", chat)
        assert result["data"]["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        assert result["data"]["request_id"] == "hook-1" and result["source"] == "tree:infer-request-parser"
        t = result["data"]["timings"]
        assert 0 < t["ttft_ms"] <= t["e2e_ms"] and result["data"]["decode_node_id"], result["data"]
        accepted = [l for l in await wait_for("infer.request.accepted") if l["data"]["request_id"] == "hook-1"]
        completed = [l for l in await wait_for("infer.request.completed") if l["data"]["request_id"] == "hook-1"]
        assert len(accepted) == 1 and len(completed) == 1, (accepted, completed)
        done = completed[0]["data"]
        assert done["ingress"] == "river" and done["outcome"] == "ok" and done["decode_node_id"], done
        assert done["timings"]["ttft_ms"] > 0 and done["timings"]["e2e_ms"] >= done["timings"]["ttft_ms"], done

    async def http_requests_have_lifecycle_leaves():
        req = urllib.request.Request(api + "/v1/chat/completions", json.dumps(chat).encode(),
                                     {"Content-Type": "application/json", "X-Request-Id": "http-8"})
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())
        for _ in range(100):
            done = [l for l in leaves.get("infer.request.completed", []) if l["data"]["request_id"] == "http-8"]
            if done:
                break
            await asyncio.sleep(0.05)
        assert len(done) == 1, done
        d = done[0]["data"]
        assert d["ingress"] == "http" and d["api"] == "/v1/chat/completions" and d["route"] in ("local", "remote"), d
        assert d["completion_tokens"] == answer["usage"]["completion_tokens"], (d, answer["usage"])
        assert d["prompt_tokens"] == answer["usage"]["prompt_tokens"] and d["decode_node_id"], d
        t = d["timings"]
        assert 0 < t["ttft_ms"] <= t["e2e_ms"] and t["tpot_ms"] > 0, t
        assert done[0]["source"] == "nim:pdserve"
        assert any(l["data"]["request_id"] == "http-8" for l in leaves.get("infer.request.accepted", []))

    async def bare_request_with_context():
        body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
                "nimsforest": {"request_id": "bare-2", "context": {"chat_id": 42}}}
        await js.publish("river.infer.requests", json.dumps(body).encode())  # no envelope: lenient
        [result] = await wait_for("infer.result.bare-2")
        want = http_answer(api, "/v1/completions", {k: v for k, v in body.items() if k != "nimsforest"})
        assert result["data"]["choices"][0]["text"] == want["choices"][0]["text"], result
        assert result["data"]["context"] == {"chat_id": 42}

    async def bad_input_is_rejected_once():
        before = len(leaves.get("infer.request.rejected", []))
        bad = [b"not json at all",
               json.dumps({"subject": "river.infer.requests", "data": "%%%", "ts": "x"}).encode(),
               river_data({"model": "m", "nimsforest": {"request_id": "bad-body"}}),
               river_data({"prompt": "hi", "max_tokens": -1, "nimsforest": {"request_id": "bad-max"}}),
               river_data({"prompt": "word " * 20000, "nimsforest": {"request_id": "bad-long"}})]
        for b in bad:
            await js.publish("river.infer.requests", b)
        rejected = await wait_for("infer.request.rejected", before + len(bad))
        ids = {l["data"]["request_id"] for l in rejected}
        assert {"bad-body", "bad-max", "bad-long"} <= ids, ids
        assert all(l["data"]["error"] for l in rejected)
        await asyncio.sleep(2)
        assert len(leaves["infer.request.rejected"]) == before + len(bad), "a bad message came back"
        info = await js.consumer_info("RIVER", "infer-request-parser")
        assert info.num_pending == 0 and info.num_ack_pending == 0, info
        # The server is still up.
        assert http_answer(api, "/v1/completions", {"prompt": "x", "max_tokens": 1})["choices"]

    async def poison_is_rejected_on_first_delivery():
        # A schema whose $ref chain is 1,000 deep: small enough to pass the size
        # bound, refused by the chain bound at validation (400), never compiled.
        defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(999)}
        defs["d999"] = {"type": "string"}
        schema = {"$ref": "#/$defs/d0", "$defs": defs}
        body = {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}}
        try:
            http_answer(api, "/v1/chat/completions", body)
            raise AssertionError("the API took a 1,000-deep $ref chain")
        except urllib.error.HTTPError as e:
            assert e.code == 400, e.code
        mine = lambda subject: [l for l in leaves.get(subject, []) if l["data"].get("request_id") == "poison-9"]
        before = await js.consumer_info("RIVER", "infer-request-parser")
        await js.publish("river.infer.requests", river_data({**body, "nimsforest": {"request_id": "poison-9"}}))
        t = time.time()
        while True:
            info = await js.consumer_info("RIVER", "infer-request-parser")
            settled = info.delivered.stream_seq > before.delivered.stream_seq and info.num_ack_pending == 0
            if mine("infer.request.rejected") and settled:
                break
            assert time.time() - t < 60, (mine("infer.request.rejected"), info)
            await asyncio.sleep(0.05)
        await asyncio.sleep(3)  # longer than the first redelivery would wait (1 s)
        [rejected] = mine("infer.request.rejected")
        assert rejected["data"]["outcome"] == "rejected" and rejected["data"]["ingress"] == "river", rejected
        assert not mine("infer.request.failed") and "infer.result.poison-9" not in leaves
        info = await js.consumer_info("RIVER", "infer-request-parser")
        # Delivered once: one more delivery for one more message, none pending.
        assert info.delivered.consumer_seq - before.delivered.consumer_seq == 1, (before, info)
        assert info.delivered.stream_seq - before.delivered.stream_seq == 1, (before, info)
        assert info.num_pending == 0 and info.num_ack_pending == 0 and info.num_redelivered == 0, info
        assert procs[2].poll() is None, "the frontend exited"
        assert http_answer(api, "/v1/chat/completions", chat)["choices"][0]["message"]["content"]

    async def deadline_passed_is_rejected_not_run():
        body = {"prompt": "late", "max_tokens": 4, "nimsforest": {"request_id": "late-3", "deadline_ms": 0}}
        await js.publish("river.infer.requests", river_data(body))
        for _ in range(100):
            if any(l["data"]["request_id"] == "late-3" for l in leaves.get("infer.request.rejected", [])):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("no rejection for a passed deadline")
        await asyncio.sleep(1)
        assert "infer.result.late-3" not in leaves

    async def twice_published_answered_once():
        body = {"prompt": "Once", "max_tokens": 8, "temperature": 0, "nimsforest": {"request_id": "twice-4"}}
        await js.publish("river.infer.requests", river_data(body))
        await js.publish("river.infer.requests", river_data(body))
        await wait_for("infer.result.twice-4")
        await asyncio.sleep(3)
        assert len(leaves["infer.result.twice-4"]) == 1, leaves["infer.result.twice-4"]

    def submit_leaf(data, subject="infer.request.submit"):
        ts = datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")
        return json.dumps({"subject": subject, "data": data, "source": "treehouse:test", "ts": ts}).encode()

    async def wind_submit():
        # As a NATS request: accepted at once, answered as Leaves.
        data = {"request_id": "wind-5", "messages": chat["messages"], "params": {"max_tokens": 12, "temperature": 0},
                "reply_to": "forest.replies.wind-5", "context": {"tree": "house"}}
        reply = json.loads((await nc.request("infer.request.submit", submit_leaf(data), timeout=10)).data)
        assert reply == {"accepted": True, "request_id": "wind-5"}, reply
        [result] = await wait_for("forest.replies.wind-5")
        want = http_answer(api, "/v1/chat/completions", chat)
        assert result["data"]["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        assert result["data"]["context"] == {"tree": "house"} and result["data"]["ingress"] == "wind"
        # A plain publish, as a Lua TreeHouse drops it; and a copy of a finished one.
        await nc.publish("infer.request.submit", submit_leaf({"request_id": "wind-6", "prompt": "Hi", "max_tokens": 3}))
        await wait_for("infer.result.wind-6")
        reply = json.loads((await nc.request("infer.request.submit", submit_leaf(data), timeout=10)).data)
        assert reply.get("duplicate") is True, reply
        # Not a valid Leaf (its subject is not the NATS subject): refused, with a Leaf.
        bad = json.loads((await nc.request("infer.request.submit", submit_leaf(data, "elsewhere"), timeout=10)).data)
        assert bad["accepted"] is False and bad["error"], bad
        await asyncio.sleep(1)
        assert len(leaves["forest.replies.wind-5"]) == 1

    async def streamed_as_leaves():
        body = {**chat, "max_tokens": 40, "stream": True, "nimsforest": {"request_id": "stream-7"}}
        await js.publish("river.infer.requests", river_data(body))
        [result] = await wait_for("infer.result.stream-7")
        parts = leaves.get("infer.stream.stream-7", [])
        assert parts, "no stream Leaves"
        assert [p["data"]["seq"] for p in parts] == list(range(1, len(parts) + 1)), parts
        assert all(p["data"]["tokens"] <= 16 for p in parts) and parts[-1]["data"]["finish_reason"], parts[-1]
        text = "".join(p["data"]["delta"] for p in parts)
        assert text == result["data"]["choices"][0]["message"]["content"], (text, result)
        want = http_answer(api, "/v1/chat/completions", {**chat, "max_tokens": 40})
        assert text == want["choices"][0]["message"]["content"], (text, want)
        assert result["data"]["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]

    async def thousand_with_a_frontend_killed():
        second = frontend(free_port())
        procs.append(second)
        await asyncio.sleep(3)  # the second frontend joins the consumer
        n = 1000
        for i in range(n):
            body = {"prompt": f"Count {i}:", "max_tokens": 2, "temperature": 0, "nimsforest": {"request_id": f"k-{i}"}}
            await js.publish("river.infer.requests", river_data(body))
        got = lambda: sum(1 for s in leaves if s.startswith("infer.result.k-"))
        t = time.time()
        while got() < n // 3:
            assert time.time() - t < 120, got()
            await asyncio.sleep(0.05)
        procs[2].kill()  # the first frontend, mid-run
        while got() < n:
            assert time.time() - t < 240, f"{got()} of {n} answered"
            await asyncio.sleep(0.1)
        await asyncio.sleep(2)
        counts = [len(leaves.get(f"infer.result.k-{i}", [])) for i in range(n)]
        assert all(c == 1 for c in counts), [i for i, c in enumerate(counts) if c != 1]
        rejected = [l for l in leaves.get("infer.request.rejected", []) if str(l["data"]["request_id"]).startswith("k-")]
        failed = [l for l in leaves.get("infer.request.failed", []) if str(l["data"]["request_id"]).startswith("k-")]
        assert not rejected and not failed, (rejected[:3], failed[:3])
        print(f"     {n} River requests answered once each in {time.time() - t:.1f} s", flush=True)

    try:
        await check("webhook_round_trip", webhook_round_trip())
        await check("bare_request_with_context", bare_request_with_context())
        await check("http_requests_have_lifecycle_leaves", http_requests_have_lifecycle_leaves())
        await check("bad_input_is_rejected_once", bad_input_is_rejected_once())
        await check("poison_is_rejected_on_first_delivery", poison_is_rejected_on_first_delivery())
        await check("deadline_passed_is_rejected_not_run", deadline_passed_is_rejected_not_run())
        await check("twice_published_answered_once", twice_published_answered_once())
        await check("wind_submit", wind_submit())
        await check("streamed_as_leaves", streamed_as_leaves())
        await check("thousand_with_a_frontend_killed", thousand_with_a_frontend_killed())
        invalid = [l for ls in leaves.values() for l in ls if "invalid" in l]
        await check("every_leaf_valid", asyncio.sleep(0) if not invalid else _fail(invalid))
    finally:
        await nc.close()
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    failed = sum(1 for _, e in RESULTS if e)
    print(f"e2e: {len(RESULTS) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


async def _fail(what):
    raise AssertionError(what)


if __name__ == "__main__":
    asyncio.run(main())
