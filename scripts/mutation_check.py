"""Plant known bugs one at a time and check that the tests covering them fail.

Each mutation replaces one exact fragment of one source file (it must occur exactly once) in a
temporary copy of the working tree, runs only the test files (or tests) that should catch it,
and counts it caught when pytest fails. The unmutated copy runs the same tests first: they must
pass, or the check stops. The mutations are bugs that once survived the suite (issues 31 and 56:
lossless outputs, broken promises about which rounds run, how much is verified, what is
estimated and what data is read) and bugs that were fixed and must stay fixed.

    python scripts/mutation_check.py            # all mutations; exit 1 if any is missed
    python scripts/mutation_check.py --list     # names and what each plants
    python scripts/mutation_check.py --only pearl_draft_cursor consultant_boundary

A developer tool, not part of `make test`: it takes several minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments: files, node ids, -k expressions
    bug: str


MUTATIONS = (
    Mutation(
        "block_first_coin", "jspec/speculative/verify/block.py",
        "n = jnp.max(jnp.where(u < h, i, 0), axis=-1).astype(jnp.int32)",
        "n = jnp.sum(jnp.cumprod((u < h).astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)",
        ("tests/test_lossless_sampling.py", "-k", "block"),
        "block verification keeps the drafts before the first failing coin, not up to the last passing one"),
    Mutation(
        "block_residual_unweighted", "jspec/speculative/verify/block.py",
        "return n, token_after(k_resample, p, draft_tokens, draft_probs, n, rejected, w_n)",
        "return n, token_after(k_resample, p, draft_tokens, draft_probs, n, rejected)",
        ("tests/test_lossless_sampling.py", "-k", "block_law"),
        "block verification's residual drops the running weight (the token rule's residual)"),
    Mutation(
        "chain_cost_extra_draft_step", "jspec/speculative/policies/auto.py",
        "(first_us + (k - 1) * step_us + cm.verify(k + 1))",
        "(first_us + k * step_us + cm.verify(k + 1))",
        ("tests/test_auto.py", "-k", "first_step_and_k_minus"),
        "auto's chain cost charges one draft step more than the table measured"),
    Mutation(
        "top_p_one_past_nucleus", "jspec/sampling.py",
        "keep_sorted = mass_before < sampling.top_p",
        "keep_sorted = jnp.concatenate([jnp.ones_like(mass_before[..., :1], bool), "
        "mass_before[..., :-1] < sampling.top_p], -1)",
        ("tests/test_lossless_sampling.py", "-k", "numpy"),
        "top-p keeps one token past the nucleus"),
    Mutation(
        "top_k_one_extra", "jspec/sampling.py",
        "kth = top_k(x, sampling.top_k)[0][..., -1:]",
        "kth = top_k(x, min(sampling.top_k + 1, x.shape[-1]))[0][..., -1:]",
        ("tests/test_lossless_sampling.py", "-k", "numpy"),
        "top-k keeps k + 1 tokens"),
    Mutation(
        "eagle_tgt_hidden_shift", "jspec/train/losses.py",
        "tgt_hidden = shift_left(target.hidden, step + 1)",
        "tgt_hidden = shift_left(target.hidden, step + 2)",
        ("tests/test_train_losses.py",),
        "training targets (features) one position late"),
    Mutation(
        "eagle_tgt_top_shift", "jspec/train/losses.py",
        "tgt_top = shift_left(target.top, step + 1)",
        "tgt_top = shift_left(target.top, step + 2)",
        ("tests/test_train_losses.py",),
        "target argmax labels one position late"),
    Mutation(
        "eagle1_no_regression", "jspec/train/losses.py",
        "loss = tc.regression_weight * masked_mean(reg, counted) + tc.ce_weight * masked_mean(ce, ce_mask)",
        "loss = tc.ce_weight * masked_mean(ce, ce_mask)",
        ("tests/test_train_losses.py",),
        "EAGLE-1's feature-regression term dropped"),
    Mutation(
        "diffuspec_argmax_not_cps", "jspec/speculative/drafters/diffusion.py",
        "        if not self.cps:\n            return jnp.argmax(x, axis=-1)",
        "        if True:\n            return jnp.argmax(x, axis=-1)",
        ("tests/test_dlm.py",),
        "the DiffuSpec drafter drafts the per-position argmax, bypassing CPS"),
    Mutation(
        "diffuspec_cps_padding", "jspec/speculative/drafters/diffusion.py",
        "n = jnp.minimum(jnp.minimum(_first_true(is_eos), limit), path_len)",
        "n = jnp.minimum(_first_true(is_eos), limit)",
        ("tests/test_dlm.py",),
        "padding past a short CPS path counted as drafts"),
    Mutation(
        "pearl_draft_cursor", "jspec/speculative/engines/pearl.py",
        "dcache=s.dcache.replace(lengths=w(new_base + new_n_pend, s.dcache.lengths)),",
        "dcache=s.dcache.replace(lengths=w(base + a + new_n_pend, s.dcache.lengths)),",
        ("tests/test_pearl.py",),
        "PEARL's draft-cache cursor one short after a rejection"),
    Mutation(
        "consultant_boundary", "jspec/speculative/verify/consultant.py",
        "n = accepted_prefix((score <= rule.eps) & valid)",
        "n = accepted_prefix((score < rule.eps) & valid)",
        ("tests/test_rules.py", "-k", "consultant"),
        "Consultant rejects a draft whose NLL equals eps"),
    Mutation(
        "specbranch_token_confidence", "jspec/speculative/engines/specbranch.py",
        "        return nxt, q, confidence(logits)\n",
        "        return nxt, q, jnp.take_along_axis(jax.nn.softmax(logits.astype(jnp.float32), -1), nxt[:, None], -1)[:, 0]\n",
        ("tests/test_specbranch.py", "-k", "chi_square"),
        "SpecBranch's cut reads the drafted token's own q(x): lossy when sampling"),
    # issue 56: one per rule its tests pin
    Mutation(
        "hybrid_lookup_any_row", "jspec/speculative/engines/tree.py",
        "return jnp.all((order >= lookup_first) | done)",
        "return jnp.any((order >= lookup_first) | done)",
        ("tests/test_hybrid.py", "-k", "looks_up_first_exactly or lookup_rule"),
        "a hybrid round verifies the n-gram chain alone when any row (not every one) matched"),
    Mutation(
        "hybrid_update_past_depth", "jspec/speculative/engines/tree.py",
        "jnp.minimum(n_drafted, D), jnp.minimum(n, D)",
        "n_drafted, jnp.minimum(n, D)",
        ("tests/test_hybrid.py", "-k", "lookup_rule"),
        "a hybrid round tells the policy it drafted past the head's depth (the n-gram branch)"),
    Mutation(
        "pruned_verify_block_too_large", "jspec/speculative/engines/tree.py",
        "jnp.searchsorted(jnp.asarray(sizes), last)",
        'jnp.searchsorted(jnp.asarray(sizes), last, side="right")',
        ("tests/test_tree.py", "-k", "smallest_block or accepts_every_kept"),
        "pruned verification takes the next block when the kept nodes fill one exactly"),
    Mutation(
        "skip_levels_all_rows", "jspec/speculative/engines/tree.py",
        "jax.lax.cond(jnp.any(depth_cap >= level), run_level, skip, ops)",
        "jax.lax.cond(jnp.all(depth_cap >= level), run_level, skip, ops)",
        ("tests/test_tree.py", "-k", "levels_run_exactly"),
        "a tree level is skipped unless every row keeps it"),
    Mutation(
        "calibrate_held_out_prompts", "jspec/tasks.py",
        "            if index % CHITCHAT_HOLDOUT_EVERY\n            for turn in turns",
        "            for turn in turns",
        ("tests/test_calibration.py", "-k", "evaluation_set"),
        "calibrate's training prompts include chitchat's held-out (evaluation) conversations"),
    Mutation(
        "auto_discount_twice", "jspec/speculative/policies/auto.py",
        "s, t = acceptance_sums(state.successes, state.trials, n_drafted, n_accepted, self.discount)",
        "s, t = acceptance_sums(self.discount * state.successes, self.discount * state.trials, n_drafted, "
        "n_accepted, self.discount)",
        ("tests/test_auto.py", "-k", "estimator"),
        "auto's per-row estimator discounts the older rounds twice a round"),
    Mutation(
        "specbranch_cut_one_before", "jspec/speculative/engines/specbranch.py",
        "(conf[:, 1:] >= threshold)",
        "(conf[:, :-1] >= threshold)",
        ("tests/test_specbranch.py", "-k", "confidence_cut_counts or drafted"),
        "SpecBranch's cut reads each continuation token's confidence one position early"),
    Mutation(
        "cps_weight_nan", "jspec/kernels/cps_search.py",
        "return jnp.where(lam != 0.0, lam * logq, 0.0) + jnp.where(lam != 1.0, (1.0 - lam) * proxy, 0.0)",
        "return lam * logq + (1.0 - lam) * proxy",
        ("tests/test_cps_search.py", "-k", "random"),
        "CPS weighs a token 0 * -inf = nan at lam 0 or 1 (kernel and portable search disagree)"),
    Mutation(
        "cps_weight_nan_lam0", "jspec/kernels/cps_search.py",
        "return jnp.where(lam != 0.0, lam * logq, 0.0) + jnp.where",
        "return lam * logq + jnp.where",
        ("tests/test_cps_search.py", "-k", "random"),
        "CPS weighs a token 0 * -inf = nan at lam 0 only (the proxy alone)"),
    Mutation(
        "tail_prefix_drops_last", "jspec/generate.py",
        "prefixes = [list(prompts[i]) + res.row(i) for i in left]",
        "prefixes = [list(prompts[i]) + res.row(i)[:-1] for i in left]",
        ("tests/test_lossless_sampling.py", "-k", "tail"),
        "a tail re-prefills a row without its last token: the tail samples from the wrong context"),
    Mutation(
        "tail_key_is_first_refills", "jspec/generate.py",
        "key, tail_key = jax.random.split(key) if tail else (key, None)",
        "tail_key = jax.random.fold_in(key, 1) if tail else None",
        ("tests/test_refill.py", "-k", "stream_no_refill"),
        "the tail samples with the first refill's key: rows correlated, each row's own law intact"),
    Mutation(
        "tail_cut_counts_dropped", "jspec/speculative/state.py",
        "accepted=before.accepted + jnp.minimum(after.accepted - before.accepted, kept)",
        "accepted=after.accepted",
        ("tests/test_refill.py", "-k", "tail or budget"),
        "a round cut at a tail row's budget still counts the drafts it dropped as accepted"),
)


def copy_tree(dest: Path) -> None:
    """The working tree's tracked and untracked (not ignored) files; models/ is linked, not copied
    (no mutation touches it, and it holds the large weights)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if rel.startswith("models/") or not (ROOT / rel).is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)
    if (ROOT / "models").is_dir():
        os.symlink(ROOT / "models", dest / "models")


def run_tests(tree: Path, args: tuple[str, ...]) -> tuple[bool, float, str]:
    """(passed, seconds, last line of pytest's output) for the tests `args` in `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-p", "no:cacheprovider", *args], cwd=tree,
                       env=env, capture_output=True, text=True)
    lines = [line for line in (r.stdout + r.stderr).strip().splitlines() if line.strip()]
    return r.returncode == 0, time.time() - t0, lines[-1] if lines else ""


def plant(tree: Path, m: Mutation) -> str:
    """Apply `m` in `tree`; returns the original text to restore."""
    path = tree / m.path
    text = path.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"mutation {m.name}: fragment found {text.count(m.old)} times in {m.path} (want 1): "
                         f"update scripts/mutation_check.py")
    path.write_text(text.replace(m.old, m.new))
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run these mutations only")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = ap.parse_args(argv)
    chosen = MUTATIONS
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in MUTATIONS})
        if unknown:
            ap.error(f"unknown mutation {', '.join(unknown)}; --list shows them")
        chosen = tuple(m for m in MUTATIONS if m.name in args.only)
    if args.list:
        for m in chosen:
            print(f"{m.name:30s} {m.path}: {m.bug}  [{' '.join(m.tests)}]")
        return 0

    with tempfile.TemporaryDirectory(prefix="jspec-mutation-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        for m in chosen:  # every fragment must be there before any test runs
            (tree / m.path).write_text(plant(tree, m))
        selections = sorted({m.tests for m in chosen})
        for sel in selections:
            ok, secs, last = run_tests(tree, sel)
            print(f"baseline  {' '.join(sel)}: {'pass' if ok else 'FAIL'} ({secs:.0f} s)", flush=True)
            if not ok:
                print(f"the unmutated tree fails {' '.join(sel)} ({last}): fix that first", file=sys.stderr)
                return 2
        rows = []
        for m in chosen:
            original = plant(tree, m)
            try:
                ok, secs, last = run_tests(tree, m.tests)
            finally:
                (tree / m.path).write_text(original)
            rows.append((m, "missed" if ok else "caught", secs))
            print(f"{'MISSED' if ok else 'caught'}  {m.name} ({secs:.0f} s): {last}", flush=True)

    print()
    print(f"| {'mutation':30s} | {'bug':75s} | {'tests':45s} | result |")
    print(f"|{'-' * 32}|{'-' * 77}|{'-' * 47}|--------|")
    for m, result, _ in rows:
        print(f"| {m.name:30s} | {m.bug:75s} | {' '.join(m.tests):45s} | {result:6s} |")
    missed = [m.name for m, result, _ in rows if result == "missed"]
    print(f"\n{len(rows) - len(missed)}/{len(rows)} caught" + (f"; missed: {', '.join(missed)}" if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
