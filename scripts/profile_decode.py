"""Profile jspec's jitted AR decode on a model of SmolLM2-135M's shape (random weights, no EOS).

Side by side in one run:
  * tokens/s of whole jitted generations (prefill + while_loop) at batch 1 and 16, layers under
    `scan` vs unrolled;
  * a differential profile of one decode step: the same step with 0, 15 and 30 layers gives the
    per-layer cost and the fixed cost (embedding, final norm, LM head, argmax, loop);
  * the kernel count per decode step, read from the compiled HLO (fusions, library calls, copies);
  * optionally transformers `generate` on the same shape (--hf).
Prints a table; writes JSON to $OUT when set.
"""
import argparse
import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec import model as M
from jspec.config import ModelConfig
from jspec.generate import DecodeState, decode_step, generate_ar_jit, plan_cache_len
from jspec.sampling import GREEDY

SMOLLM2 = ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                      max_position_embeddings=8192, tie_word_embeddings=True, eos_token_ids=())

KERNEL_OPS = ("fusion", "custom-call", "copy", "scatter", "dynamic-update-slice", "gather", "sort", "dot",
              "reduce", "convolution", "all-reduce", "copy-start")


def time_generation(params, cfg, batch, prompt_len, new, unroll, reps=3):
    toks = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (batch, prompt_len)), jnp.int32)
    lens = jnp.full((batch,), prompt_len, jnp.int32)
    kw = dict(max_new=new, cache_len=plan_cache_len(prompt_len, new), sampling=GREEDY, unroll=unroll)
    run = lambda: jax.block_until_ready(generate_ar_jit(params, cfg, toks, lens, jax.random.PRNGKey(0), **kw))
    t0 = time.perf_counter(); run(); compile_s = time.perf_counter() - t0
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); run(); ts.append(time.perf_counter() - t0)
    t = float(np.median(ts))
    return dict(kind="generate", batch=batch, unroll=str(unroll), compile_s=round(compile_s, 2), wall_s=t,
                tokens_per_s=batch * new / t, ms_per_step=1000 * t / new)


def step_fn(cfg, unroll):
    def steps(params, state, n):
        return jax.lax.fori_loop(0, n, lambda i, s: decode_step(params, cfg, GREEDY, 10**6, s, unroll=unroll), state)
    return jax.jit(steps, static_argnums=2, donate_argnums=1)


def make_state(params, cfg, batch, cache_len):
    cache = M.init_cache(cfg, batch, cache_len, params["embed"].dtype)
    cache = cache.replace(lengths=jnp.full((batch,), 64, jnp.int32))
    z = lambda: jnp.zeros((batch,), jnp.int32)  # distinct buffers: the state is donated
    return DecodeState(cache=cache, out=jnp.zeros((batch, 1), jnp.int32), n_out=z(), last=z(), done=jnp.zeros((batch,), bool),
                       steps=z(), key=jax.random.PRNGKey(0))


def time_steps(params, cfg, batch, unroll, n=200, cache_len=640):
    f = step_fn(cfg, unroll)
    s = f(params, make_state(params, cfg, batch, cache_len), n)
    jax.block_until_ready(s)
    t0 = time.perf_counter()
    s = f(params, make_state(params, cfg, batch, cache_len), n)
    jax.block_until_ready(s)
    return 1000 * (time.perf_counter() - t0) / n


def kernel_count(params, cfg, batch, unroll, cache_len=640):
    """Kernel-launching HLO instructions per decode step, from the compiled module."""
    f = jax.jit(lambda p, s: decode_step(p, cfg, GREEDY, 10**6, s, unroll=unroll))
    text = f.lower(params, make_state(params, cfg, batch, cache_len)).compile().as_text()
    comps, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"^(ENTRY )?%?([\w.\-]+) ", line)
        if m and line.rstrip().endswith("{"):
            cur = m.group(2); comps[cur] = []
        elif cur and "=" in line:
            op = re.search(r"=\s*[^ ]+\s+([a-z\-]+)\(", line)
            if op:
                comps[cur].append(op.group(1))
    entry = [c for c in comps if c.startswith("main")] or list(comps)[-1:]
    count = lambda ops: sum(o in KERNEL_OPS for o in ops)
    # scan over layers compiles to a while loop whose body runs once per layer
    bodies = re.findall(r"\bwhile\(.*?body=%?([\w.\-]+)", text)
    body_k = max((count(comps.get(c, [])) for c in bodies), default=0)
    return dict(entry_kernels=count(comps[entry[0]]) if entry else None, layer_body_kernels=body_k)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--hf", action="store_true")
    ap.add_argument("--quick", action="store_true", help="skip the layer-count sweep")
    a = ap.parse_args()
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    card = jax.devices()[0].device_kind
    params = M.init_params(SMOLLM2, jax.random.PRNGKey(0), dtype)
    rows = []
    for batch in (1, 16):
        for unroll in (1, True):
            r = time_generation(params, SMOLLM2, batch, a.prompt, a.new, unroll); r["method"] = "jspec"; rows.append(r); print(r, flush=True)
    for unroll in (1, True):
        r = dict(kind="kernels", unroll=str(unroll), **kernel_count(params, SMOLLM2, 1, unroll)); rows.append(r); print(r, flush=True)
    if not a.quick:
        for L in (0, 15, 30):  # differential profile: fixed cost + L x per-layer cost
            cfg = SMOLLM2.replace(num_layers=L)
            p = {**params, "layers": jax.tree.map(lambda x: x[:L], params["layers"])}
            r = dict(kind="step", layers=L, batch=1, ms_per_step=time_steps(p, cfg, 1, 1)); rows.append(r); print(r, flush=True)
    if a.hf:
        import torch
        import transformers

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        hcfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                        num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                                        max_position_embeddings=8192, tie_word_embeddings=True)
        m = transformers.LlamaForCausalLM(hcfg).to(dev, torch.bfloat16 if dev == "cuda" else torch.float32).eval()
        for batch in (1, 16):
            ids = torch.randint(0, 49152, (batch, a.prompt), device=dev)
            kw = dict(max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False, pad_token_id=0)
            m.generate(ids, **kw)
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter(); m.generate(ids, **kw)
            if dev == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter() - t0
            r = dict(kind="generate", method="hf", batch=batch, wall_s=t, tokens_per_s=batch * a.new / t, ms_per_step=1000 * t / a.new)
            rows.append(r); print(r, flush=True)
    print(f"card: {card}, jax {jax.__version__}, dtype {jnp.dtype(dtype).name}")
    for r in rows:
        print(r)
    if os.environ.get("OUT"):
        json.dump(dict(card=card, jax=jax.__version__, rows=rows), open(os.path.join(os.environ["OUT"], "profile_decode.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
