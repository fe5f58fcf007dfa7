"""`jspec` command line: generate, convert, info, bench, train-head."""

from __future__ import annotations

import argparse
import os
import sys
import time

from .checkpoint.convert import add_convert_args, run_convert
from .decode import pack_prompts
from .generate import generate, generate_stream
from .presets import list_presets, resolve_model
from .sampling import Sampling
from .sharding import parse_mesh
from .speculative.engines.chain import speculative_stream
from .speculative.factory import build_drafter
from .speculative.policies import make_policy
from .tokenizer import prompt_ids

# `bench` and `train-head` are imported where they run: they pull heavy optional stacks
# (transformers/torch peers, matplotlib; optax/orbax training extras, which may be absent).

DEFAULT_MODEL = "smollm2-135m-instruct"


def _dtype_arg(name: str | None):
    import jax.numpy as jnp

    return None if name in (None, "auto") else jnp.dtype(name)


def add_generate_args(p: argparse.ArgumentParser):
    p.add_argument("prompt", nargs="+", help="prompt text (several prompts run as one batch)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="preset name, HF dir, .gguf file or Orbax dir")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", help="float32 | bfloat16 | auto (float32 on CPU, bfloat16 elsewhere)")
    p.add_argument("--drafter", default=None,
                   help="speculative drafter: ngram[:N], early-exit[:E], model:PATH, eagle[:PATH], eagle3[:PATH]")
    p.add_argument("--policy", default="static",
                   help="draft-length policy: static, confidence, heuristic, svip, adaedl, tapout, ldlp, adl")
    p.add_argument("--k-max", type=int, default=8, help="maximum draft tokens per round")
    p.add_argument("--verify", default="lossless", choices=["lossless", "consultant"],
                   help="'consultant' is Consultant Decoding's LOSSY rule (output differs from the target's)")
    p.add_argument("--no-stream", action="store_true", help="print only when generation finishes")
    p.add_argument("--mesh", default=None,
                   help="run on several devices: data=N (rows split, each device loops on its own) or "
                        "model=N (tensor-parallel target); implies --no-stream")


def cmd_generate(a) -> int:
    if a.mesh:
        try:
            a.mesh, a.no_stream = parse_mesh(a.mesh), True  # a bad spec fails here, before loading
        except ValueError as e:
            print(f"jspec generate: {e}", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    cfg, params, tok = resolve_model(a.model, dtype=_dtype_arg(a.dtype))
    prompts = [prompt_ids(tok, text, a.chat) for text in a.prompt]
    sampling = Sampling(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p)
    print(f"[jspec] {a.model}: loaded in {time.perf_counter() - t0:.1f}s, dtype {params['embed'].dtype}", file=sys.stderr)

    if a.drafter is not None and len(prompts) == 1 and not a.no_stream:
        return _stream_speculative(a, cfg, params, tok, prompts[0], sampling)
    if a.drafter is None and len(prompts) == 1 and not a.no_stream:
        t0 = time.perf_counter()
        ids: list[int] = []
        printed = ""
        for chunk in generate_stream(params, cfg, prompts[0], max_new_tokens=a.max_new_tokens, sampling=sampling, seed=a.seed):
            ids += chunk
            text = tok.decode(ids, skip_special_tokens=True)
            print(text[len(printed):], end="", flush=True)
            printed = text
        dt = time.perf_counter() - t0
        print(f"\n[jspec] {len(ids)} tokens in {dt:.2f}s ({len(ids) / dt:.1f} tok/s incl. compile)", file=sys.stderr)
        return 0

    policy = None
    drafter = None
    if a.drafter:
        drafter, dparams = build_drafter(a.drafter, cfg, params, model_name=a.model)
        policy = make_policy(a.policy, k_max=a.k_max)
    kw = dict(max_new_tokens=a.max_new_tokens, sampling=sampling, seed=a.seed, mesh=a.mesh)
    if drafter is not None:
        kw.update(drafter=drafter, drafter_params=dparams, policy=policy, k_max=a.k_max, verify=a.verify)
    t0 = time.perf_counter()
    res = generate(params, cfg, prompts, **kw)
    dt = time.perf_counter() - t0
    for b in range(len(prompts)):
        if len(prompts) > 1:
            print(f"--- [{b}]")
        print(tok.decode(res.row(b), skip_special_tokens=True))
    n = int(res.lengths.sum())
    print(f"[jspec] {n} tokens in {dt:.2f}s ({n / dt:.1f} tok/s incl. compile); target calls {res.target_calls.tolist()}", file=sys.stderr)
    if drafter is not None:
        mat = (res.lengths / res.target_calls).round(2).tolist()
        rate = (res.accepted / res.drafted.clip(1)).round(3).tolist()
        print(f"[jspec] drafter {a.drafter} policy {a.policy} verify {a.verify}: rounds {res.rounds.tolist()}, "
              f"drafted {res.drafted.tolist()}, accepted {res.accepted.tolist()}, acceptance {rate}, "
              f"mean accepted tokens per target call {mat}", file=sys.stderr)
    return 0


def _stream_speculative(a, cfg, params, tok, prompt, sampling) -> int:
    import jax

    drafter, dparams = build_drafter(a.drafter, cfg, params, model_name=a.model)
    policy = make_policy(a.policy, k_max=a.k_max)
    tokens, lens, cache_len = pack_prompts(cfg, [prompt], a.max_new_tokens, a.k_max + 1)
    t0 = time.perf_counter()
    ids: list[int] = []
    printed, state = "", None
    for chunk, state in speculative_stream(
        params, cfg, tokens, lens, jax.random.PRNGKey(a.seed), drafter=drafter, drafter_params=dparams,
        policy=policy, k_max=a.k_max, max_new=a.max_new_tokens, cache_len=cache_len, sampling=sampling, verify=a.verify,
    ):
        ids += chunk
        text = tok.decode(ids, skip_special_tokens=True)
        print(text[len(printed):], end="", flush=True)
        printed = text
    dt = time.perf_counter() - t0
    calls, drafted, accepted = (int(x) for x in jax.device_get((state.target_calls[0], state.drafted[0], state.accepted[0])))
    print(f"\n[jspec] {len(ids)} tokens in {dt:.2f}s ({len(ids) / dt:.1f} tok/s incl. compile)", file=sys.stderr)
    print(f"[jspec] drafter {a.drafter} policy {a.policy} verify {a.verify}: target calls {calls}, drafted {drafted}, "
          f"accepted {accepted} (acceptance {accepted / max(drafted, 1):.3f}), "
          f"mean accepted tokens per target call {len(ids) / max(calls, 1):.2f}", file=sys.stderr)
    return 0


def cmd_info(a) -> int:
    import jax

    print(f"jax {jax.__version__} backend {jax.default_backend()} devices {jax.devices()}")
    print("presets:", ", ".join(list_presets()))
    if a.model:
        cfg, params, _ = resolve_model(a.model, tokenizer=False)
        n = sum(x.size for x in jax.tree.leaves(params))
        print(f"{a.model}: {n / 1e6:.1f}M parameters, dtype {params['embed'].dtype}")
        for k, v in cfg.to_dict().items():
            print(f"  {k}: {v}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jspec", description="Dynamic speculative decoding in JAX")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_generate_args(sub.add_parser("generate", help="generate text (AR or speculative)"))
    info = sub.add_parser("info", help="devices, presets, a model's config")
    info.add_argument("--model", default=None)

    add_convert_args(sub.add_parser("convert", help="convert checkpoints (HF / GGUF -> Orbax, Orbax -> HF)"))
    bench = sub.add_parser("bench", help="benchmark methods side by side (Spec-Bench metrics)")
    train = sub.add_parser("train-head", help="train an EAGLE-1/EAGLE-3 draft head")
    from .bench.cli import add_bench_args

    add_bench_args(bench)
    try:
        from .train.cli import add_train_args

        add_train_args(train)
    except ImportError:  # training extras absent
        pass

    a = parser.parse_args(argv)
    if a.cmd == "generate":
        return cmd_generate(a)
    if a.cmd == "info":
        return cmd_info(a)
    if a.cmd == "convert":
        return run_convert(a) or 0
    if a.cmd == "bench":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch peers
        from .bench.cli import run_bench

        run_bench(a)
        return 0
    if a.cmd == "train-head":
        from .train.cli import run_train

        return run_train(a) or 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
