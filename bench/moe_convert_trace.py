#!/usr/bin/env python3
"""Convert published expert-routing traces of real MoE models into ferry's form.

ferry's form (what `ferry moe gen` writes and `ferry moe replay` reads): a
header line {"model", "num_layers", "num_experts", "top_k"}, then one line
per (token, layer) step, {"token": t, "layer": l, "experts": [...]}; a step
that serves several tokens at once (a prefill batch) says "tokens": n and
lists the union of their experts.

No third-party data is kept in ferry: each source is fetched by whoever runs
this, from the repository, commit and path cited below and in the README.

Sources (--format):

  onnx-genai  justinchuby/onnx-genai, commit 44604f3187bad3e415c21fb523da171675f0e135,
              scripts/moe_expert_trace.json: ibm-granite/granite-3.0-1b-a400m-instruct
              (24 MoE layers, 32 experts, top-8, the trained router) on three prompts
              (english_prose, code, math), greedy, 64 decode tokens each; per token and
              layer the 8 expert ids, for every prompt token (prefill) and every
              generated token (decode). Written by that commit's
              scripts/dump_moe_expert_trace.py (ONNX Runtime, CPU EP).

  olmoe-race  helloimrizy-pages/opt, commit cdd89062f93bb6e7b04fdd25a602757d542a1ad7,
              stage3_residency/traces/full/chunks/<domain>/sequence_NNNN.npz (400 files,
              schema olmoe_decode_atomic_routing_v1): allenai/OLMoE-1B-7B-0924 (revision
              6d84c485, bf16, A40) decoding greedily up to 128 new tokens for 400 prompts,
              100 per domain (general: wikitext-103, coding, math, reasoning); 51,112
              generated tokens, each with its 8 expert ids (of 64) at all 16 MoE layers,
              prefill not recorded. SRC is the chunks directory (or one domain's folder,
              or one .npz); the aggregate routing_trace.npz of the same schema works too.
              Needs numpy.

  vllm-jsonl  Mario928/speculative-moe, commit 216e26eb86ee09fa46bb0e8c000be7e9758e10b6,
              routing_data_collected/gsm8k_2_routing.jsonl and humaneval_2_routing.jsonl
              (later commits keep them in Git LFS only): mistralai Mixtral-8x7B-Instruct-v0.1
              (FP8) in vLLM with a routing profiler in its fused MoE layer, greedy decode of
              two GSM8K and two HumanEval problems (79-255 tokens each); one line per
              (problem, generated token, layer) with the top-2 expert ids (of 8) at all 32
              MoE layers, prefill not recorded. A problem's last 1-3 tokens were cut off
              part-way through the layers by the capture; they are dropped.

Usage:
  moe_convert_trace.py --format onnx-genai SRC.json --prompt NAME|all
                       [--prefill none|batch|tokens] -o OUT.jsonl
  moe_convert_trace.py --format olmoe-race SRC [--domain D|all] -o OUT.jsonl
  moe_convert_trace.py --format vllm-jsonl SRC.jsonl [--problem N|all] -o OUT.jsonl

--prompt all (onnx-genai), --domain all (olmoe-race, sequence id order,
domain by domain) and --problem all (vllm-jsonl) concatenate the requests' decode streams, as one engine
serving them one after another (token numbers run on, the cache is kept).
--prefill none (default) keeps decode only; batch adds each prompt's prefill
as one step per layer (the union of its tokens' experts, as an engine runs a
prefill batch layer by layer); tokens adds it token by token.
"""
import argparse
import json
import os
import sys


def fail(msg):
    sys.stderr.write("moe_convert_trace: %s\n" % msg)
    sys.exit(1)


def check_route(where, route, num_experts, top_k):
    if not isinstance(route, list) or len(route) != top_k:
        fail("%s: expected a list of %d expert ids, got %r" % (where, top_k, route))
    for e in route:
        if not isinstance(e, int) or e < 0 or e >= num_experts:
            fail("%s: expert id %r outside 0..%d" % (where, e, num_experts - 1))
    if len(set(route)) != len(route):
        fail("%s: repeated expert id in %r" % (where, route))


def onnx_genai_steps(doc, prompt, prefill):
    """Yield (ntok, layer, experts) per step, token order then layer order."""
    nl, ne, k = doc["num_layers"], doc["num_experts"], doc["top_k"]
    prompts = doc["prompts"]
    names = list(prompts) if prompt == "all" else [prompt]
    for name in names:
        if name not in prompts:
            fail("no prompt %r in the file (it has %s)" % (name, ", ".join(prompts)))
        p = prompts[name]
        parts = []
        if prefill == "batch" and p["prefill"]:
            parts.append(("batch", p["prefill"]))
        elif prefill == "tokens":
            parts.append(("tokens", p["prefill"]))
        parts.append(("tokens", p["decode"]))
        for kind, rows in parts:
            for i, row in enumerate(rows):
                if len(row) != nl:
                    fail("%s token %d: %d layers, header says %d" % (name, i, len(row), nl))
                for l, route in enumerate(row):
                    check_route("%s token %d layer %d" % (name, i, l), route, ne, k)
            if kind == "batch":
                for l in range(nl):
                    union = sorted({e for row in rows for e in row[l]})
                    yield len(rows), l, union
            else:
                for row in rows:
                    for l in range(nl):
                        yield 1, l, list(row[l])


def convert_onnx_genai(src, args, out):
    with open(src) as f:
        doc = json.load(f)
    for key in ("num_layers", "num_experts", "top_k", "prompts"):
        if key not in doc:
            fail("%s: no %r field; not an onnx-genai moe_expert_trace.json" % (src, key))
    nl = doc["num_layers"]
    label = "%s %s %s" % (str(doc.get("model", "?")).split()[0], args.prompt,
                          "decode" if args.prefill == "none" else "prefill-%s+decode" % args.prefill)
    out.write(json.dumps({"model": label[:63], "num_layers": nl, "num_experts": doc["num_experts"],
                          "top_k": doc["top_k"]}) + "\n")
    token = 0
    steps = 0
    for ntok, layer, experts in onnx_genai_steps(doc, args.prompt, args.prefill):
        rec = {"token": token, "layer": layer}
        if ntok != 1:
            rec["tokens"] = ntok
        rec["experts"] = experts
        out.write(json.dumps(rec, separators=(",", ":")) + "\n")
        steps += 1
        if layer == nl - 1:
            token += 1
    return token, steps


RACE_DOMAINS = ("general", "coding", "math", "reasoning")


def race_files(src):
    if os.path.isfile(src):
        return [src]
    if not os.path.isdir(src):
        fail("%s: neither a file nor a directory" % src)
    found = []
    for root, _, names in os.walk(src):
        found += [os.path.join(root, n) for n in names if n.endswith(".npz")]
    if not found:
        fail("%s: no .npz files under it" % src)
    return found


def race_sequences(src, domain):
    """Yield (sequence_id, routes[tokens][layers][8]) in sequence id order."""
    try:
        import numpy as np
    except ImportError:
        fail("olmoe-race needs numpy (run with a python3 that has it, e.g. /usr/bin/python3)")
    seqs = {}
    nl = None
    for path in race_files(src):
        try:
            d = np.load(path)
            d["schema_version"]
        except (OSError, ValueError, KeyError) as e:
            fail("%s: not an olmoe_decode_atomic_routing_v1 .npz (%s)" % (path, e))
        if str(d["schema_version"]) != "olmoe_decode_atomic_routing_v1":
            fail("%s: schema %s, expected olmoe_decode_atomic_routing_v1" % (path, d["schema_version"]))
        ids = d["requested_expert_ids"]
        for seq in np.unique(d["sequence_id"]):
            m = d["sequence_id"] == seq
            dom = RACE_DOMAINS[int(d["domain_id"][m][0])]
            if domain != "all" and dom != domain:
                continue
            if int(seq) in seqs:
                fail("%s: sequence %d seen twice" % (path, seq))
            tok, lay, ex = d["generated_token_index"][m], d["layer_index"][m], ids[m]
            order = np.lexsort((lay, tok))
            tok, lay, ex = tok[order], lay[order], ex[order]
            layers = int(lay.max()) + 1
            ntok = int(tok.max()) + 1
            if len(tok) != ntok * layers or not (lay.reshape(ntok, layers) == np.arange(layers)).all():
                fail("%s: sequence %d is not every layer of every token" % (path, seq))
            if nl is None:
                nl = layers
            elif nl != layers:
                fail("%s: %d layers, earlier sequences %d" % (path, layers, nl))
            if ex.min() < 0 or ex.max() >= 64:
                fail("%s: sequence %d has expert ids outside 0..63" % (path, seq))
            seqs[int(seq)] = ex.reshape(ntok, layers, ex.shape[1])
    if not seqs:
        fail("%s: no sequence of domain %s" % (src, domain))
    return nl, [seqs[k] for k in sorted(seqs)]


def convert_olmoe_race(src, args, out):
    nl, seqs = race_sequences(src, args.domain)
    k = seqs[0].shape[2]
    # expert_bytes: three 2048 x 1024 bf16 matrices, the metadata's expert_bytes_by_layer
    out.write(json.dumps({"model": "OLMoE-1B-7B-0924 %s decode" % args.domain, "num_layers": nl,
                          "num_experts": 64, "top_k": k, "expert_bytes": 12582912}) + "\n")
    token = steps = 0
    for routes in seqs:
        for row in routes:
            for l in range(nl):
                route = [int(e) for e in row[l]]
                if len(set(route)) != k:
                    fail("token %d layer %d: repeated expert id in %r" % (token, l, route))
                out.write('{"token":%d,"layer":%d,"experts":%s}\n'
                          % (token, l, json.dumps(route, separators=(",", ":"))))
                steps += 1
            token += 1
    sys.stderr.write("%d sequences\n" % len(seqs))
    return token, steps


MIXTRAL_LAYERS, MIXTRAL_EXPERTS, MIXTRAL_TOP_K = 32, 8, 2


def convert_vllm_jsonl(src, args, out):
    """Mixtral-8x7B decode routing, one JSON object per (problem, token, layer)."""
    by = {}
    name = None
    with open(src) as f:
        for n, line in enumerate(f, 1):
            try:
                r = json.loads(line)
                p, t, l, route = r["problem_id"], r["token_idx"], r["layer"], r["experts"]
            except (ValueError, KeyError, TypeError):
                fail("%s line %d: not a routing record" % (src, n))
            name = name or r.get("dataset", "?")
            if not isinstance(l, int) or l < 0 or l >= MIXTRAL_LAYERS:
                fail("%s line %d: layer %r outside 0..%d" % (src, n, l, MIXTRAL_LAYERS - 1))
            check_route("%s line %d" % (src, n), route, MIXTRAL_EXPERTS, MIXTRAL_TOP_K)
            by.setdefault(p, {}).setdefault(t, {})[l] = route
    if not by:
        fail("%s: no routing records" % src)
    probs = sorted(by) if args.problem == "all" else [int(args.problem)]
    out.write(json.dumps({"model": "Mixtral-8x7B %s %s decode" % (name, args.problem),
                          "num_layers": MIXTRAL_LAYERS, "num_experts": MIXTRAL_EXPERTS,
                          "top_k": MIXTRAL_TOP_K, "expert_bytes": 3 * 4096 * 14336 * 2}) + "\n")
    token = steps = dropped = 0
    for p in probs:
        if p not in by:
            fail("%s: no problem %r (it has %s)" % (src, p, ", ".join(map(str, sorted(by)))))
        for t in sorted(by[p]):
            layers = by[p][t]
            if len(layers) != MIXTRAL_LAYERS:  # (cut off by the capture)
                dropped += 1
                continue
            for l in range(MIXTRAL_LAYERS):
                out.write('{"token":%d,"layer":%d,"experts":%s}\n'
                          % (token, l, json.dumps(layers[l], separators=(",", ":"))))
                steps += 1
            token += 1
    sys.stderr.write("%d problems, %d partial tokens dropped\n" % (len(probs), dropped))
    return token, steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("--format", required=True, choices=["onnx-genai", "olmoe-race", "vllm-jsonl"])
    ap.add_argument("--prompt", default="all")
    ap.add_argument("--prefill", default="none", choices=["none", "batch", "tokens"])
    ap.add_argument("--domain", default="all", choices=("all",) + RACE_DOMAINS)
    ap.add_argument("--problem", default="all")
    ap.add_argument("-o", "--out", required=True)
    args = ap.parse_args()
    with open(args.out, "w") as out:
        conv = {"onnx-genai": convert_onnx_genai, "olmoe-race": convert_olmoe_race,
                "vllm-jsonl": convert_vllm_jsonl}[args.format]
        tokens, steps = conv(args.src, args, out)
    sys.stderr.write("%s: %d tokens, %d steps\n" % (args.out, tokens, steps))


if __name__ == "__main__":
    main()
