"""What theory predicts for the GPT input/output path: Keras' sparse second moment, per-shard labelled counts.

Sparse second moment (docs/layers.md "Token layers", docs/framework-differences.md). An
``embedding``'s TensorFlow gradient is a ``tf.IndexedSlices``, one slice per occurrence of an
id. Keras 3.15's Adam (AMSGrad, AdamW), RMSprop and Adagrad square it slice by slice
(``ops.square`` of ``IndexedSlices``) before the duplicates are summed, so a row looked up at
positions ``I_r`` gets ``sum_{i in I_r} g_i^2`` where every exact rule (torch's dense gradient,
``tfpar``'s formula optimizers, tf.compat.v1's optimizers, which deduplicate first) gets
``G^2 = (sum g_i)^2``. It is zero exactly when

* the side does not hand Keras an ``IndexedSlices`` with a second-moment optimizer: a
  built-in TensorFlow engine whose optimizers are Keras' (``optimizer_family`` ``keras``: tf.towers,
  tf.single, tf.mirrored, tf.multiworker) running Keras' class (``semantics: native``, or a
  ``keras_rounding`` mapping); tf.v1's ``tf.compat.v1`` optimizers deduplicate;
* the embedding's gradient is ``dense`` (the mapping), or the table is also used by a
  ``tied_logits`` (TensorFlow's gradient aggregation densifies the sum of the dense and the
  sparse term: measured);
* no token id repeats in what one application of the optimizer sees: the global batch of
  a step under ``grad_mean``/``loss_mean`` (tf.towers and tf.distribute concatenate the devices'
  slices, so an id once on each of two devices counts as a repeat), a device's shard under
  ``param_mean``/``async`` (``spec["data"]["token_facts"]``, derived from ``x`` at validation);
* no step moves the parameters (a learning rate of 0 at every step).

Its size depends on the gradients (first step, k equal occurrences: Adam ``lr (sqrt(k) - 1)``
per element), so it is predicted as an expected, not certain, difference at the ``update``
stage, mapped by ``model.layers.<i>.gradient: dense`` on the sparse side.

Sparse clipping norm. TensorFlow's global norm of an ``IndexedSlices`` (``tf.clip_by_global_norm``,
``tf.linalg.global_norm``, Keras' ``clipnorm``) sums the squares of its slices, ``sum_i |g_i|^2``,
where the dense gradient's norm has ``|G|^2``: with ``parallel.clip`` and a repeated id, the
clipping coefficient differs on steps that reach the threshold (not certain; same mapping).

Labelled counts (``ignore_label``): each device's loss is the mean over its labelled
positions; devices combine their means with weights ``w_r`` (1/N, or n_r/B for ``by_size``),
one device takes the mean over all of them. The two agree exactly when ``w_r = c_r / C``
for every step (``c_r`` labelled positions on device r, ``C`` in all): equal counts under
``equal`` weighting, counts proportional to rows under ``by_size``. No field maps it. Predicted
when some step's counts are not so, as not certain: the steps whose counts are agree (a
lockstep run judges each step alone).
"""

from __future__ import annotations

from typing import Any

from parity_tests.contract.tokens import FACTS_KEY

__all__ = ["SECOND_MOMENT_OPTIMIZERS", "sparse_embeddings", "runs_keras_class", "sparse_moment", "sparse_clip_norm",
           "labelled_counts", "embedding_mapping"]

#: Keras optimizers whose state squares the gradient (``ops.square``: per occurrence on IndexedSlices)
SECOND_MOMENT_OPTIMIZERS = ("adam", "amsgrad", "adamw", "rmsprop", "adagrad")
_LABEL = {"adam": "Adam", "amsgrad": "AMSGrad", "adamw": "AdamW", "rmsprop": "RMSprop", "adagrad": "Adagrad"}
SPARSE_MOMENT = "sparse embedding second moment"
SPARSE_CLIP = "sparse embedding clipping norm"


def sparse_embeddings(layers: list[dict]) -> list[str]:
    """Paths of the embedding layers whose TensorFlow gradient reaches the optimizer as ``IndexedSlices``
    (``gradient: native`` and not named by a ``tied_logits``)."""
    tied = {layer["embedding"] for layer in layers if layer["type"] == "tied_logits"}
    return [str(i) for i, layer in enumerate(layers)
            if layer["type"] == "embedding" and layer["gradient"] == "native" and str(i) not in tied]


def runs_keras_class(spec: dict[str, Any]) -> bool:
    """Whether a Keras-family built-in runs Keras' own optimizer class for this case (``tfpar.optimizers.make_optimizer``)."""
    opt = spec["optimizer"]
    return opt["semantics"] == "native" or opt.get("keras_rounding", "none") != "none"


def sparse_moment(spec: dict[str, Any], sparse_a: bool, sparse_b: bool, moves: bool,
                  absent: list[str]) -> str | None:
    """The difference's text when exactly one side squares per occurrence at these values, else ``None``
    (with the reason in ``absent`` when the set-up would make it and the values do not).

    ``sparse_a``/``sparse_b``: the side is a Keras-family built-in TensorFlow engine (``theory``).
    """
    model, opt = spec["model"], spec["optimizer"]
    paths = sparse_embeddings(model["layers"])
    if not any(layer["type"] == "embedding" for layer in model["layers"]):
        return None
    name = opt["name"]
    a, b = (s and runs_keras_class(spec) for s in (sparse_a, sparse_b))
    if a == b or name not in SECOND_MOMENT_OPTIMIZERS:
        return None
    if not paths:
        absent.append(f"{SPARSE_MOMENT}: the embedding's gradient is dense (gradient: dense, or the table is"
                      " tied to the logits, whose dense gradient TensorFlow adds to it)")
        return None
    if not moves:
        absent.append(f"{SPARSE_MOMENT}: no step moves the parameters")
        return None
    facts = spec["data"].get(FACTS_KEY) or {}
    own = spec["parallel"]["combine"] in ("param_mean", "async")
    where = "a device's shard" if own else "a step's global batch (all devices' slices together)"
    if not facts.get("repeat_in_shard" if own else "repeat_in_batch", True):
        absent.append(f"{SPARSE_MOMENT}: no token id repeats within {where}")
        return None
    where_layers = ", ".join(f"model.layers.{p}" for p in paths)
    return (f"{SPARSE_MOMENT}: Keras' {_LABEL[name]} squares an embedding's IndexedSlices gradient per occurrence"
            f" (sum g_i^2) before duplicate ids are summed; torch's dense gradient gives (sum g_i)^2 (a token id"
            f" repeats within {where}; {where_layers})")


def _clips_slices(spec: dict[str, Any], tf_builtin: bool, family: str) -> bool:
    """Whether a side clips an embedding's ``IndexedSlices`` with TensorFlow's norm (over its slices).

    A built-in TensorFlow engine whose clipping is TensorFlow's (``tf.clip_by_global_norm``'s
    arithmetic: optimizer ``semantics`` native or tf; ``torch`` densifies first). ``per_device``
    clips each device's own gradient, sparse on every engine; ``after_combine`` the combined one,
    still sparse where the combine concatenates slices (``tf.towers``, ``tf.single``, ``tf.mirrored``,
    and ``tf.v1`` under ``loss_mean``; ``tf.v1``'s classic ``average_gradients`` densifies under ``grad_mean``).
    """
    clip = spec["parallel"].get("clip")
    if not tf_builtin or clip is None or spec["optimizer"]["semantics"] == "torch":
        return False
    return clip["where"] == "per_device" or family == "keras" or spec["parallel"]["combine"] == "loss_mean"


def sparse_clip_norm(spec: dict[str, Any], a: tuple[bool, str], b: tuple[bool, str], moves: bool,
                     absent: list[str]) -> str | None:
    """TensorFlow's global norm of an ``IndexedSlices`` is over its slices, ``sqrt(sum_i |g_i|^2)``, not of the
    dense ``G``: clipping then scales by another coefficient once the threshold is reached (both
    ``tf.clip_by_global_norm`` and Keras' ``clipnorm`` square per slice). ``a``/``b``: (built-in
    TensorFlow engine, optimizer family) of each side."""
    clip = spec["parallel"].get("clip")
    if clip is None or not any(layer["type"] == "embedding" for layer in spec["model"]["layers"]):
        return None
    sa, sb = _clips_slices(spec, *a), _clips_slices(spec, *b)
    if sa == sb:
        return None
    paths = sparse_embeddings(spec["model"]["layers"])
    if not paths:
        absent.append(f"{SPARSE_CLIP}: the embedding's gradient is dense")
        return None
    if not moves:
        absent.append(f"{SPARSE_CLIP}: no step moves the parameters")
        return None
    facts = spec["data"].get(FACTS_KEY) or {}
    own = clip["where"] == "per_device" or spec["parallel"]["combine"] in ("param_mean", "async")
    where = "a device's shard" if own else "a step's global batch"
    if not facts.get("repeat_in_shard" if own else "repeat_in_batch", True):
        absent.append(f"{SPARSE_CLIP}: no token id repeats within {where}")
        return None
    return (f"{SPARSE_CLIP}: TensorFlow's global norm of an embedding's IndexedSlices gradient is taken over its"
            f" slices, sqrt(sum |g_i|^2), not over the summed gradient as torch's clip_grad_norm_ takes it, so"
            f" clipping scales by another coefficient on steps that reach the threshold (a token id repeats"
            f" within {where}; {', '.join(f'model.layers.{p}' for p in paths)})")


def labelled_counts(spec: dict[str, Any], one_parallel: bool) -> str | None:
    """The per-shard labelled-count difference of an ``ignore_label`` case between N devices and one, or ``None``."""
    model, par = spec["model"], spec["parallel"]
    facts = spec["data"].get(FACTS_KEY) or {}
    if not one_parallel or model.get("ignore_label") is None or model["reduction"] != "mean":
        return None
    weighting = par["weighting"]
    if facts.get({"equal": "labelled_equal", "by_size": "labelled_by_size"}.get(weighting, ""), True):
        return None
    return (f"per-device labelled counts: with ignore_label {model['ignore_label']} each device averages over its"
            f" own labelled positions and the {par['devices']} means are combined with weighting {weighting}, which"
            " is not the mean over the whole batch's labelled positions (the shards hold different counts)")


def embedding_mapping(spec: dict[str, Any], tf_builtin: bool, family: str) -> dict[str, Any] | None:
    """``model.layers.<i>.gradient: dense`` for every sparse embedding, on the side that squares or clips an
    ``IndexedSlices`` (a built-in TensorFlow engine: Keras' optimizer class, or TensorFlow's clipping norm)."""
    keras_class = tf_builtin and family == "keras" and runs_keras_class(spec)
    if not (keras_class or _clips_slices(spec, tf_builtin, family)):
        return None
    paths = sparse_embeddings(spec["model"]["layers"])
    return {f"model.layers.{p}.gradient": "dense" for p in paths} or None
