"""The prompts of the speculation benchmark (scripts/bench-spec.sh), one file a workload.

Workloads (each a chat request's user message; `pdserve bench load --prompts` sends
them, greedy, `ignore_eos`):
  code:    return a source file of this repository whole, with one line added;
  quote:   quote a passage of Hamlet (scripts/fetch-text.sh) exactly;
  extract: pull fields out of a text as JSON;
  open:    open-ended chat.
Every request of a workload has its own prompt (another file, passage, person or
story), the same list on every run: greedy requests with one prompt would write one
text, and a request could draft what another wrote before it, which no two users'
requests do.

Usage: bench_spec.py TEXT_FILE OUT_DIR N    writes OUT_DIR/<workload>.jsonl, N prompts each
"""
import glob
import json
import sys

ROOT = __file__.rsplit("/scripts/", 1)[0]

NAMES = ["Maria Lopez", "Jonas Berg", "Aiko Tanaka", "Omar Haddad", "Lena Novak", "Kofi Mensah", "Sofia Rossi",
         "Ravi Iyer", "Emma Dubois", "Tomas Silva", "Nadia Petrova", "Liam Walsh", "Mei Chen", "Pedro Alves",
         "Hana Kim", "Youssef Amari"]
CITIES = ["Lisbon", "Porto", "Oslo", "Bergen", "Osaka", "Kyoto", "Beirut", "Tunis", "Prague", "Brno", "Accra",
          "Kumasi", "Turin", "Genoa", "Pune", "Lyon", "Nantes", "Recife", "Natal", "Busan"]
TRADES = ["a bakery", "a bike shop", "a tea house", "a bookshop", "a pottery studio", "a flower stall",
          "a repair shop", "a print shop"]
STORIES = ["a lighthouse keeper who finds a message in a bottle", "a clockmaker whose clocks run backwards",
           "a girl who can talk to rivers", "a robot that learns to bake bread", "two rival chess players stuck in "
           "a lift", "a fox that runs a post office", "an astronaut who loses her keys on the moon",
           "a village where it never stops snowing", "a detective who is afraid of the dark",
           "a painter who paints only doors", "a dragon who collects teacups", "a ship's cat on its last voyage",
           "a librarian who finds a book with no ending", "a beekeeper and a storm", "a boy who builds a kite "
           "from maps", "a grandmother who was once a pilot", "a town band that forgot its song",
           "a gardener growing a tree of glass"]


def workloads(text_file):
    """Each workload's prompts, as an endless list (request k takes the k-th)."""
    files = sorted(glob.glob(f"{ROOT}/crates/*/src/*.rs"))
    hamlet = open(text_file).read()
    start = hamlet.index("To be, or not to be")

    def code(k):
        src = open(files[k % len(files)]).read()[:3000]
        return (f"Here is a Rust file.\n\n```rust\n{src}\n```\n\nReturn the whole file unchanged except for "
                "one line `// Reviewed.` added at its top. Output only the code.")

    def quote(k):
        at = start + (k * 1500) % (len(hamlet) - start - 1500)
        at = hamlet.index("\n", at) + 1
        return f"Here is a passage from Hamlet.\n\n{hamlet[at:at + 1500]}\n\nQuote the passage exactly, from the start."

    def extract(k):
        name, frm, to = NAMES[k % len(NAMES)], CITIES[k % len(CITIES)], CITIES[(3 * k + 7) % len(CITIES)]
        facts = (f"{name}, {24 + k % 40}, moved from {frm} to {to} in {2001 + k % 24}. They run {TRADES[k % len(TRADES)]} "
                 f"on Main Street {3 + k} and employ {2 + k % 9} people. Their phone number is +1 555 {1000 + 37 * k}.")
        return (f"{facts}\n\nReturn JSON with the fields name, age, from_city, to_city, business, street, "
                "employees and phone, each copied from the text.")

    def story(k):
        return f"Tell me a story about {STORIES[k % len(STORIES)]}, in {CITIES[k % len(CITIES)]}."

    return {"code": code, "quote": quote, "extract": extract, "open": story}


def main():
    text, out_dir, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    for name, make in workloads(text).items():
        with open(f"{out_dir}/{name}.jsonl", "w") as f:
            for k in range(n):
                f.write(json.dumps(make(k)) + "\n")


if __name__ == "__main__":
    main()
