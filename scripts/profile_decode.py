"""Time jspec's jitted AR decode on a model of SmolLM2-135M's shape (random weights, no EOS).

Side by side in one run: layer scan vs unrolled layers, batch 1 and 16, and transformers
`generate` on the same shape when torch sees a GPU. Prints a table; writes JSON to $OUT if set.
"""
import argparse, json, os, time

import jax, jax.numpy as jnp, numpy as np

from jspec.config import ModelConfig
from jspec import model as M
from jspec.generate import generate_ar_jit, plan_cache_len

SMOLLM2 = ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                      max_position_embeddings=8192, tie_word_embeddings=True, eos_token_ids=())


def time_jspec(params, cfg, batch, prompt_len, new, unroll, reps=3):
    toks = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (batch, prompt_len)), jnp.int32)
    lens = jnp.full((batch,), prompt_len, jnp.int32)
    kw = dict(max_new=new, cache_len=plan_cache_len(prompt_len, new), sampling=__import__("jspec.sampling", fromlist=["GREEDY"]).GREEDY, unroll=unroll)
    t0 = time.perf_counter(); jax.block_until_ready(generate_ar_jit(params, cfg, toks, lens, jax.random.PRNGKey(0), **kw)); c = time.perf_counter() - t0
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); jax.block_until_ready(generate_ar_jit(params, cfg, toks, lens, jax.random.PRNGKey(0), **kw)); ts.append(time.perf_counter() - t0)
    t = float(np.median(ts))
    return dict(batch=batch, unroll=str(unroll), compile_s=c, wall_s=t, tokens_per_s=batch * new / t, ms_per_step=1000 * t / new)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--hf", action="store_true")
    a = ap.parse_args()
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    params = M.init_params(SMOLLM2, jax.random.PRNGKey(0), dtype)
    rows = []
    for batch in (1, 16):
        for unroll in (1, True):
            r = time_jspec(params, SMOLLM2, batch, a.prompt, a.new, unroll); r["method"] = "jspec"; rows.append(r); print(r, flush=True)
    if a.hf:
        import torch, transformers
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        hcfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True)
        m = transformers.LlamaForCausalLM(hcfg).to(dev, torch.bfloat16 if dev == "cuda" else torch.float32).eval()
        for batch in (1, 16):
            ids = torch.randint(0, 49152, (batch, a.prompt), device=dev)
            kw = dict(max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False, pad_token_id=0)
            m.generate(ids, **kw)
            if dev == "cuda": torch.cuda.synchronize()
            t0 = time.perf_counter(); m.generate(ids, **kw)
            if dev == "cuda": torch.cuda.synchronize()
            t = time.perf_counter() - t0
            r = dict(method="hf", batch=batch, wall_s=t, tokens_per_s=batch * a.new / t, ms_per_step=1000 * t / a.new); rows.append(r); print(r, flush=True)
    print(f"{'method':6} {'batch':>5} {'unroll':>6} {'tok/s':>9} {'ms/step':>8}")
    for r in rows:
        print(f"{r['method']:6} {r['batch']:5d} {r.get('unroll',''):>6} {r['tokens_per_s']:9.1f} {r['ms_per_step']:8.3f}")
    if os.environ.get("OUT"):
        json.dump(rows, open(os.path.join(os.environ["OUT"], "profile_decode.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
