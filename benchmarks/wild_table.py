"""The table of docs/wild-bugs.md, from the tool's own output on every example of examples/wild/.

    .venv/bin/python benchmarks/wild_table.py            # prints the markdown table (about a minute)

Each example's buggy version against its reference (the built-in, or the example's fixed / full-batch
version where the built-in does not compute the example's loss), at the example's own case
(float64, its device count): the verdict, the first bad step and stage, the factor, and whether the
logged loss alone (assert_allclose, rtol = atol = 1e-3) would have flagged it in the case's steps.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from parity_tests.contract.case import load_case  # noqa: E402
from parity_tests.session.comparison import compare_case  # noqa: E402

WILD = ROOT / "examples" / "wild"

#: folder -> (thread, the bug in a few words, reference: a built-in or a function of the example)
EXAMPLES = {
    "funasr-no-sync-first-microbatch": ("modelscope/FunASR PR #3472", "`no_sync` on the first micro-batch, not the last", "torch.ddp"),
    "torchtitan-ddp-double-average": ("pytorch/torchtitan PR #2323", "global-token loss, DDP still averaging: / N twice", "torch.ddp"),
    "arctic-dp-size-dropped": ("Snowflake-AI-Research/Arctic-Platform PR #119", "`dp_size` dropped from a global-denominator loss", "torch.ddp"),
    "automodel-dp-size-local-mean": ("NVIDIA-NeMo/Automodel #3846, PR #3830", "`loss * dp_size` on a local mean, micro-batches summed", "torch.ddp"),
    "transformers-ga-token-normaliser": ("huggingface/transformers PR #34191 (#35438, #37766)", "token loss averaged per micro-batch", "full_batch"),
    "keras-accumulation-weight-decay": ("keras-team/keras #19990, PR #19998", "decay and step counter per micro-step", "tf.towers"),
    "torchtune-scale-grads-world-size": ("meta-pytorch/torchtune PR #2172", "`scale_grads(1 / num_tokens)` after DDP's average", "torch.ddp"),
    "llmc-loss-not-reduced": ("karpathy/llm.c PR #551", "rank 0's loss logged, not all-reduced", "torch.ddp"),
    "llmc-sync-toggle-after-forward": ("karpathy/llm.c d05e848", "`require_backward_grad_sync` set after the forward", "torch.ddp"),
    "modded-nanogpt-loss-logging": ("KellerJordan/modded-nanogpt #2", "rank 0's `loss.item()` logged", "torch.ddp"),
    "declutr-all-gather-scale": ("JohnGiorgi/DeCLUTR PR #212", "loss over `all_gather`ed outputs not times N", "fixed"),
    "torchtitan-pp-sum-loss": ("pytorch/torchtitan #2972", "summed loss backpropagated (PP path)", "torch.ddp"),
}


def _impl(example: str, fn: str) -> str:
    if "." in fn:
        return fn
    plugin = "tf_keras.py" if example.startswith("keras") else "ddp.py"
    return f"{WILD / example / plugin}:{fn}"


def row(example: str) -> str:
    thread, bug, ref = EXAMPLES[example]
    case = load_case(WILD / example / "case.json")
    par = case.spec["parallel"]
    setup = f"N = {par['devices']}" + (f", k = {par['accumulate']}" if par.get("accumulate", 1) > 1 else "")
    pair = compare_case(case, [_impl(example, ref), _impl(example, "buggy")]).pairs[0]
    v, where = pair.verdict, pair.localisation or {}
    factor = (where.get("factor") or {}).get("text", "-")
    factor = factor.replace(" the reference's", "")
    ranks = (where.get("ranks") or {}).get("norms")
    if ranks:  # replicas apart (localise._replicas): each rank's applied |g| against rank 0's, no factor claimed
        factor = f"ranks' \\|g\\| of {where['ranks']['name']}: " + ", ".join(
            f"rank {r} {g / ranks[0][1]:.3g}x rank 0's" for r, g in ranks[1:])
    stage = f"step {where.get('first_bad_step')}, `{where.get('stage')}`" + (
        f" (rank {where['device']})" if where.get("device") is not None else "")
    lo = where.get("loss_only") or {}
    if lo.get("detectable"):
        loss = f"yes, at step {lo['first_step']} (gap {lo['max_relative_gap']:.2g})"
    elif lo:
        loss = f"no in {case.spec['steps']} steps (gap {lo['max_relative_gap']:.2g}): " + "; ".join(
            w.split(":")[0] for w in lo["why_not"])
    else:
        loss = "-"
    return (f"| {thread} | {bug} | {setup} | {factor} | {stage} | {loss} | {v.status} ({v.rule}, gap {v.gap:.3g}) |")


def main() -> None:
    t0 = time.perf_counter()
    print("| thread | bug | set-up | factor | first step, stage | loss alone (rtol 1e-3) | verdict |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for example in EXAMPLES:
        print(row(example), flush=True)
    print(f"\n({len(EXAMPLES)} examples, {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
