#!/usr/bin/env python3
"""Puts the GPU step times of scripts/gpu_step_times.py into a derived profile.

The profile keeps its model, KV, link and host figures; its one shape's points
become the timed steps, and `pdserve profile --refit` fits the step cost to them
(the same fit `pdserve profile` makes of the steps it times). The step-cost lines of
its assumptions give way to one that says where the points come from. The profile
stays marked derived: these are PyTorch's kernels on the GPU, not a server's.

    python3 scripts/gpu_profile.py --steps gpu-steps.json --model llama3.1-8b \
        --profile profiles/h200-llama3.1-8b.json --steps-path bench-results/gpu-steps.json
"""
import argparse
import json
import os
import subprocess
import tempfile

STEP_TERMS = (": fixed_s", ": token_s", ": pair_s", ": decode_pair_s", ": logits_s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", required=True, help="gpu_step_times.py's JSON")
    ap.add_argument("--model", required=True, help="its model key, e.g. llama3.1-8b")
    ap.add_argument("--profile", required=True, help="the derived profile to rewrite in place")
    ap.add_argument("--steps-path", help="where the steps JSON is kept, to cite (default: --steps)")
    ap.add_argument("--pdserve", default="target/release/pdserve")
    a = ap.parse_args()
    steps = json.load(open(a.steps))
    timed = [p for p in steps["models"][a.model]["points"] if "seconds" in p]
    points = [{k: p[k] for k in ("type", "size", "context", "seconds")} | {"fitted": 0.0} for p in timed]
    prof = json.load(open(a.profile))
    if len(prof["shapes"]) != 1:
        raise SystemExit("a derived GPU profile has one shape (one GPU)")
    prof["shapes"][0]["points"] = points
    c = steps["ceilings"]
    source = (
        f"step times of PyTorch {steps['torch']} kernels on one {steps['device']}, "
        f"{steps['date']}: {len(points)} steps timed by scripts/gpu_step_times.py "
        f"({a.steps_path or a.steps}); copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
        f"8192-cube BF16 product {c['bf16_flops'] / 1e12:.0f} TFLOP/s"
        + (f", FP8 {c['fp8_flops'] / 1e12:.0f} TFLOP/s" if "fp8_flops" in c else "")
    )
    pv = prof["provenance"]
    pv["sources"] = [s for s in pv["sources"] if not s.startswith("step times of PyTorch")] + [source]
    kept = [s for s in pv["assumptions"] if not s.endswith(STEP_TERMS) and not s.startswith("step cost fitted")]
    pv["assumptions"] = [
        "step cost fitted to the timed steps (pdserve profile --refit); each step is every layer's "
        "projections, norms, SiLU and attention (fused kernel or two batched products, the faster) and "
        "the LM head for the rows sampled, as one CUDA graph; one layer's weights and K/V serve every "
        "layer (each many times the L2), RoPE and sampling are left out"
    ] + kept
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as t:
        json.dump(prof, t, indent=2)
    try:
        subprocess.run([a.pdserve, "profile", "--refit", t.name, "--out", a.profile], check=True)
    finally:
        os.unlink(t.name)


if __name__ == "__main__":
    main()
