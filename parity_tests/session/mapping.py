"""Mapping a predicted difference away: which side runs with the other side's semantics, and through what.

A built-in runs mapped itself; a plugin through the built-in of its kind (:data:`STAND_INS`), only once
that stand-in is shown to compute what the plugin computes (:func:`stand_in_leg`); where it is not, on the
plugin itself, rerun with the mapped values of its case (:func:`on_itself`, :func:`reads_mapping`). What each run's
optimizer held and which rule it follows are read from the runs (:func:`held_roundings`, :func:`own_rules`,
:func:`follows_its_class`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from parity_tests.contract.case import Case
from parity_tests.judging.theory import LOSS_SCALE, Prediction, engine, mapping_changes
from parity_tests.judging.verdict import Verdict
from parity_tests.protocol.errors import CaseError
from parity_tests.session.declared import declared as _declared
from parity_tests.session.executor import Need, Runs
from parity_tests.session.keys import FLOAT64, RULE64, RunKey, as_given

__all__ = ['MAPPED', 'NOT_EQUIVALENT', 'STAND_INS', 'CLASS_RULE', 'CASE_MAPPINGS', 'SideMapping', 'on_itself',
           'reads_mapping', 'changed_fields', 'keras_rounding_of', 'held_roundings', 'writes_own_rule', 'torch_rule_of', 'torch_rule_from', 'own_rules', 'rule_runs', 'follows_its_class', 'choose_mapping', 'stand_in_apart', 'stand_in_leg', 'residual_unjudged',
           'kind_run', 'CASE_COMPUTED', 'float64_shown']


MAPPED = "+mapped"  # the trajectory key suffix of a run with the predicted differences mapped away
#: what a pair's line and report.json say when its mapping ran on a stand-in that does not compute what the
#: plugin computes (``_Judged.residual``)
NOT_EQUIVALENT = "residual not judged: no equivalent run"


#: the built-in that computes what a plugin of each kind computes (framework, splits the batch)
STAND_INS = {("tf", True): "tf.towers", ("tf", False): "tf.single", ("torch", True): "torch.ddp",
             ("torch", False): "torch.single"}


@dataclass(frozen=True)
class SideMapping:
    """Make ``side`` compute what ``other`` computes: run ``runs_as`` with ``changes`` (``theory.mapping_changes``).

    ``runs_as`` is ``side`` itself when it is a built-in. When ``side`` is a plugin, it is first
    the built-in of the same kind (:data:`STAND_INS`), and the residual is judged through it:
    ``side`` against the built-in as it runs, and ``other`` against the built-in mapped. Both at
    parity means the pair's gap is the predicted one (the triangle inequality through the
    built-in's two runs). Where that built-in is no equivalent run, ``runs_as`` is the plugin
    itself, rerun with the mapped values of its case (``itself``: :func:`on_itself`).
    """

    side: str
    other: str
    changes: dict[str, Any]
    runs_as: str
    #: a stand-in's own changes, so that as it runs it computes what the plugin computes (a TensorFlow
    #: plugin's Keras optimizer holds its own float32 hyperparameters, or none): ``None`` for none
    plain: SideMapping | None = None
    #: a plugin rerun itself with the mapped values of its case (:func:`on_itself`), not a built-in
    itself: bool = False

    @property
    def stand_in(self) -> bool:
        return self.runs_as != self.side

    @property
    def ident(self) -> tuple[str, str]:
        return self.runs_as, self.key

    @property
    def key(self) -> str:
        """The trajectory key suffix of the mapped runs (one per mapping: pairs may map the same side differently)."""
        digest = hashlib.sha256(repr(sorted((k, repr(v)) for k, v in self.changes.items())).encode()).hexdigest()[:8]
        return f"{MAPPED}:{digest}"

    @property
    def text(self) -> str:
        shown = ", ".join(f"{k} {'removed' if v is ... else v}" for k, v in self.changes.items()
                          if not (v is ... and k.startswith("parallel.") and k != "parallel.clip"))
        through = (f" (standing in for {self.side})" if self.stand_in else
                   " itself (a plugin, reading it from its case)" if self.itself else "")
        return f"{self.runs_as}{through} run with {shown}"

    def apply(self, case: Case) -> Case:
        return case.replace(**self.changes)


def keras_rounding_of(impl: str, traj: Any) -> str | None:
    """What a TensorFlow plugin's Keras optimizer held in float32, from what its run saw.

    ``floatx_float32`` / ``floatx_float64``: every Keras optimizer it made was made under that
    ``keras.config.floatx()`` (its learning-rate variable's dtype, ``tfpar.keras_seen``); ``none``: it
    made no Keras optimizer (its own rule, hyperparameters exact); ``ambiguous``: optimizers of
    both kinds. ``None`` for a built-in or an implementation that does not report it.
    """
    found = _declared(impl)
    if found is None or found.kind == "builtin" or found.framework != "tf":
        return None
    seen = getattr(traj, "meta", {}).get("keras_optimizers")
    if seen is None:
        return None
    # Keras' classes only: a tf.compat.v1 optimizer (``family``) holds what it was given (as before it was seen)
    dtypes = {o.get("lr_dtype") for o in seen if not o.get("family")}
    if not dtypes:
        return "none"
    if len(dtypes) > 1:
        return "ambiguous"
    return {"float32": "floatx_float32", "float64": "floatx_float64"}.get(dtypes.pop(), "ambiguous")


def held_roundings(impls: list[str], trajs: Mapping[RunKey, Any], dtype: str) -> dict[str, str | None]:
    """:func:`keras_rounding_of` for each implementation, read from the run whose numbers decide.

    A float32 case is decided by its float64 runs where they exist: what a plugin's optimizer held
    there (a plugin that follows docs/plugins.md's Keras recipe, ``set_floatx(run.dtype)``, holds its
    learning rate in float64 in its float64 run, and in float32 in its float32 run, where every
    number is float32 anyway) is what the mapping must reproduce. Without a float64 run (a
    float32-only plugin, judged by the perturbation), the case dtype's run.
    """
    return {impl: keras_rounding_of(impl, trajs.get(RunKey(impl, FLOAT64), trajs.get(RunKey(impl, as_given(dtype)), {})))
            for impl in impls}


def writes_own_rule(impl: str, traj: Any) -> bool:
    """Whether the TensorFlow plugin ``impl`` made no optimizer of a framework's class in the run ``traj``.

    Neither a Keras optimizer nor a ``tf.compat.v1`` one (``tfpar.keras_seen``): its update rule is
    what its code writes out (``theory.predict``'s ``own``). ``False`` for a built-in, a torch side
    or a run that does not report it (:func:`torch_rule_of` says it for a torch plugin).
    """
    found = _declared(impl)
    if found is None or found.kind == "builtin" or found.framework != "tf":
        return False
    seen = getattr(traj, "meta", {}).get("keras_optimizers")
    return seen is not None and not seen


def torch_rule_of(impl: str, traj: Any) -> str | None:
    """Why the torch plugin ``impl``'s update rule is not torch's class for the case, from its run; ``None`` if it is.

    Read from what the run made (``torchref.torch_seen``): the optimizer handed to
    ``run.use_optimizer`` where there is one, else every ``torch.optim`` optimizer it made. No
    ``torch.optim`` class at all: its rule is its own code's (Keras' Adam written out, a
    ``torch.optim.Optimizer`` subclass with its own ``step``); one whose class or values are not
    what the case's optimizer makes (``torch.optim.Adam`` where the case says ``adamw``, another
    ``eps``): its rule is another. ``None`` also for a built-in, a TensorFlow side, and a run that
    does not report it (a recorded run).
    """
    found = _declared(impl)
    if found is None or found.kind == "builtin" or found.framework != "torch":
        return None
    seen = getattr(traj, "meta", {}).get("torch_optimizers")
    return None if seen is None else torch_rule_from(seen)


def torch_rule_from(seen: list[dict[str, Any]]) -> str | None:
    """:func:`torch_rule_of` from a run's records (``torchref.torch_seen``): ``None`` where it runs torch's class
    for the case at the case's values (the handed optimizer where there is one, else every ``torch.optim`` one)."""
    handed = [o for o in seen if o.get("handed")]
    steps = handed or [o for o in seen if o.get("family") == "torch.optim"]
    if all(o.get("family") != "torch.optim" for o in steps):  # none, or a handed one with a step of its own
        made = ", ".join(sorted({o["rule"] for o in (steps or seen)}))
        return ("made no torch.optim optimizer" + (f" (only {made}, with a step of its own)" if made else "")
                + ", so its update rule is its own code's")
    other = next((o for o in steps if not o.get("case_rule")), None)
    if other is not None:
        return f"made {other['differs']}: its update rule is not torch's for the case's optimizer"
    return None


def own_rules(impls: list[str], trajs: Mapping[RunKey, Any], dtype: str) -> dict[str, str]:
    """The implementations of ``impls`` whose update rule is not their framework's class for the case, and why.

    A TensorFlow plugin that made no Keras or ``tf.compat.v1`` optimizer (:func:`writes_own_rule`);
    a torch plugin that made no ``torch.optim`` optimizer, or one that is not the case's
    (:func:`torch_rule_of`). Read from the run whose numbers decide (its float64 run where it made one).
    """
    out: dict[str, str] = {}
    for impl in impls:
        traj = trajs.get(RunKey(impl, FLOAT64), trajs.get(RunKey(impl, as_given(dtype)), {}))
        if writes_own_rule(impl, traj):
            out[impl] = "made no Keras or tf.compat.v1 optimizer, so its update rule is its own code's"
        elif (why := torch_rule_of(impl, traj)) is not None:
            out[impl] = why
    return out


def rule_runs(runs: Runs, case64: Case) -> Callable[[str, Mapping[str, Any]], Any]:
    """``float64_run(name, changes)`` for :func:`follows_its_class`: ``name``'s float64 run of ``case64`` with
    ``changes``, declared to ``runs`` (which makes it once, into its runs): the pair's own float64 run where
    there is one and nothing changes; else under a key of its own (``name@float64+rule``: a built-in with its
    class's rule, a plugin judged without a float64 run), so that no other rule reads it as the pair's. A
    TensorFlow built-in's run goes to the server's child where this process has not imported TensorFlow
    (a compare of plugins alone keeps it free of TensorFlow's import and memory)."""
    def float64_run(name: str, changes: Mapping[str, Any]) -> Any:
        if not changes and RunKey(name, FLOAT64) in runs.trajs:
            return runs.trajs[RunKey(name, FLOAT64)]
        return runs.make([Need(RunKey(name, RULE64), lambda: case64.replace(**changes), in_server=True)])[0]

    return float64_run


#: the case changes that make the built-in of each framework run that framework's own class's rule with the
#: case's numbers exact, as a rule written out by hand holds them (``contract.optimizer``)
CLASS_RULE = {"tf": {"optimizer.semantics": "tf", "optimizer.keras_rounding": "none"},
              "torch": {"optimizer.semantics": "torch"}}


def follows_its_class(own: Mapping[str, str], float64_run: Callable[[str, Mapping[str, Any]], Mapping[str, Any]],
                      spec: Mapping[str, Any]) -> dict[str, str]:
    """``own`` without the plugins whose own code computes what their framework's class does for the case.

    A plugin that makes no optimizer of its framework (``own_rules``) may still write out exactly
    that framework's rule (a TF program with Keras' Adam by hand, as the hunt's rewrites do):
    theory's optimizer predictions then hold for it as for the class. Read from the runs, not
    assumed: the plugin's float64 run against the built-in of its kind (:data:`STAND_INS`) running
    that class's rule with exact numbers (:data:`CLASS_RULE`), every parameter at every step by the
    float64 rule (``float64_run(name, changes)``: each made once, also where the pair itself is
    judged in float32). At parity its rule is the class's (it
    leaves ``own``); apart, or where it cannot run float64, its rule stays its own (a TF program
    with torch's AdamW by hand parts from Keras' AdamW at the first update). A plugin whose run
    parts from the built-in for another reason (a loss term the case cannot express) stays too:
    theory then predicts no optimizer difference for it, as before this check. Under a
    learning-rate schedule the built-in's class rule follows the case's curve, as a rule written out
    does: parity there says the plugin's update rule is the class's and its rate the curve, not
    Keras' ``CosineDecay`` (one step late), so its schedule stays its own (theory's ``own_schedule``:
    every plugin of ``own_rules``, whatever this check finds).
    """
    from parity_tests.judging.rules import judge_float64

    out = dict(own)
    for impl in own:
        found = _declared(impl)
        if found is None or found.kind == "builtin" or "float64" not in found.dtypes or not found.rerunnable:
            continue
        run = float64_run(impl, {})
        try:
            stand = float64_run(STAND_INS[(found.framework, found.parallel)], CLASS_RULE[found.framework])
        except CaseError:  # a case the built-in cannot run so (an optimizer only plugins know): stays its own
            continue
        keys = [k for k in run if k.startswith("param/") and k in stand]
        if keys and judge_float64(stand, run, keys=keys, loss=False).status == "parity":
            del out[impl]
    return out


def choose_mapping(spec: dict[str, Any], ref: str, impl: str, pred: Prediction,
                   rounding: dict[str, str | None], own: Collection[str] = (),
                   own_schedule: Collection[str] = ()) -> SideMapping | None:
    """The side of ``(ref, impl)`` to run with the predicted differences mapped away, and how (or ``None``).

    A side can be mapped when every *expected* difference has a mapping onto it
    (``theory.mapping_changes``); known differences are mapped where they can be. A built-in
    side runs mapped itself; a plugin side through its stand-in (:class:`SideMapping`), unless
    the model is external (no built-in runs it). The judged implementation is tried first, then
    the reference, built-ins before stand-ins. ``rounding``: per TensorFlow plugin, what its Keras
    optimizer held (:func:`keras_rounding_of`); ``own``: the plugins whose rule is their code's (:func:`own_rules`).
    """
    if not any(d.mapping for d in pred.differences):
        return None
    direct, through = [], []
    for side, other in ((impl, ref), (ref, impl)):
        found = _declared(side)
        if found is None:
            continue
        if found.kind == "builtin":
            direct.append((side, other, side))
        elif "external" not in spec["model"]:  # a plugin or a recorded run: through a built-in of its kind
            through.append((side, other, STAND_INS[(found.framework, found.parallel)]))
    for side, other, runs_as in direct + through:
        changes: dict[str, Any] = {}
        fits = True
        for d in pred.differences:
            if d.mapping == LOSS_SCALE:  # mapped on the program itself (loss_scale.ExactScale), beside this mapping
                continue
            held = rounding.get(other)
            c = (None if d.mapping is None or held == "ambiguous"
                 else mapping_changes(d.mapping, spec, engine(runs_as), engine(other), held, own, own_schedule))
            if c is None or any(k in changes and changes[k] != v for k, v in c.items()):
                if d.expected:
                    fits = False
                    break
                continue
            changes.update(c)
        if fits and changes:
            # a stand-in first computes as the plugin does (its own Keras roundings), then as the other side
            plain = (mapping_changes("optimizer", spec, engine(runs_as), engine(side), rounding.get(side), own, own_schedule)
                     if runs_as != side and spec["optimizer"]["semantics"] in ("native", "tf") else None)
            if plain and all(k.startswith("optimizer.") and spec["optimizer"].get(k[len("optimizer."):], "none") == v
                             for k, v in plain.items()):
                plain = None  # the stand-in as the case is given already computes so (else the same run twice)
            merged = {**(plain or {}), **changes}
            if merged.get("optimizer.semantics", spec["optimizer"]["semantics"]) != "tf" \
                    and merged.get("optimizer.keras_rounding", "none") != "none":
                # the plugin's own Keras roundings belong to Keras' rule: mapped onto the other framework's rule
                # (``semantics: torch``, exact numbers) they go with it (else the mapped case is invalid and the
                # pair loses its mapping: a model.fit program against a torch port under native Adam)
                merged["optimizer.keras_rounding"] = "none"
            return SideMapping(side, other, merged, runs_as, SideMapping(side, side, plain, runs_as) if plain else None)
    return None


#: the mappings a plugin can take on itself, through the case it reads (``run.spec``): its parallel set-up
#: (theory's ``mapping_changes`` of these kinds change ``parallel.*`` fields alone). The others change what only
#: the tool's own implementations read (``optimizer.keras_rounding``, a layer's ``semantics``) or the program
#: (Keras' loss scale, ``session.loss_scale``). Not ``weighting: sum`` (the sum reduction's mapping): a value of the
#: contract few programs run (one reading ``weighting`` as ``by_size`` or else ``equal`` would rerun ``equal``, read
#: and unmapped); the sum reduction's residual is checked by its exact ratio instead (``judging.predicted_scale``).
CASE_MAPPINGS = frozenset({"weighting", "clip", "combine", "batch_norm", "micro_batches"})


def on_itself(m: SideMapping | None, spec: dict[str, Any], pred: Prediction, rounding: Mapping[str, str | None],
              own: Collection[str] = (), own_schedule: Collection[str] = ()) -> SideMapping | None:
    """``m``'s mapping made on the plugin ``m.side`` itself, for where its stand-in is no equivalent run; or ``None``.

    Issue 35, item 1: a residual is judged only on a run shown to compute what the plugin
    computes apart from the mapped difference. Where the built-in standing in for it does not
    (:func:`stand_in_leg`), the plugin itself, rerun with the mapped values of its case, is that
    run, provided it reads them (:func:`reads_mapping`, asked of its runs). Only where every
    difference theory maps is a case value of the parallel set-up (:data:`CASE_MAPPINGS`) that
    theory can map onto the plugin's side: a difference left unmapped would stay in the residual
    and make a divergence of its own. Not for a plugin that cannot be rerun, has no float64 run
    (the reading is shown by the float64 runs) or is nondeterministic (its rerun differs anyway).
    """
    from parity_tests.session.spread import nondeterministic

    if m is None or not m.stand_in:
        return None
    found = _declared(m.side)
    if (found is None or found.kind == "builtin" or not found.rerunnable or "float64" not in found.dtypes
            or nondeterministic(m.side)):
        return None
    changes: dict[str, Any] = {}
    for d in pred.differences:
        if d.mapping is None:
            continue
        if d.mapping not in CASE_MAPPINGS:
            return None
        c = mapping_changes(d.mapping, spec, engine(m.side), engine(m.other), rounding.get(m.other), own, own_schedule)
        if c is None or any(k in changes and changes[k] != v for k, v in c.items()):
            return None
        changes.update(c)
    return SideMapping(m.side, m.other, changes, m.side, itself=True) if changes else None


def changed_fields(spec: Mapping[str, Any], changes: Mapping[str, Any]) -> list[str]:
    """The dotted fields of ``spec`` that ``changes`` (``Case.replace``'s, e.g. ``{"parallel.clip": {...}}``) change:
    the leaves whose value differs (``parallel.clip.where``), a field it removes where the case has it."""
    def at(node: Any, path: str) -> Any:
        for part in path.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        return node

    def leaves(path: str, old: Any, new: Any) -> list[str]:
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            return [f for k in sorted({*old, *new}) for f in leaves(f"{path}.{k}", old.get(k), new.get(k))]
        if new is ...:
            return [path] if old is not None else []
        return [path] if old != new else []

    return [f for k, v in changes.items() for f in leaves(k, at(spec, k), v)]


def reads_mapping(run64: Mapping[str, Any], mapped64: Mapping[str, Any], fields: Collection[str]) -> bool:
    """Whether a plugin's float64 rerun with the mapped case values (:func:`on_itself`) read them: an equivalent run.

    A plugin that does not read a value from its case (one that hard-codes ``equal`` weighting)
    reruns the same computation: its rerun is then no mapping at all, and its gap to the other side
    would be the predicted difference itself. Where the run reports what it read of its case (a
    plugin's harness records ``run.spec``: ``protocol.case_read``, ``meta["case_read"]``), every
    changed field (:func:`changed_fields`) must be among what its rerun read by name; it then runs
    the mapped values as its own code does, and a rerun that computes what it did before is the
    plugin's answer to the mapped case (a tower that updates its own copy clips it the same before
    or after its "combine"). Where it does not report it (a runner that is no plugin's harness, such
    as the hunt's mutants: a built-in run on a mutated case), the rerun counts only where it parts
    from the run without the mapping by the float64 rule, on every array both recorded
    (parameters, state, the gradients applied, the loss): a program that reads the value computes
    another update wherever theory's difference acts (it acts here: the pair parts, or no residual
    would be asked for).
    """
    from parity_tests.judging.rules import judge_float64
    from parity_tests.protocol.case_read import reads

    seen = getattr(mapped64, "meta", {}).get("case_read")
    if seen is not None:
        return bool(fields) and all(reads(seen, f) for f in fields)

    def parts(prefixes: tuple[str, ...], loss: bool) -> bool:  # (a parameter has a row more than a gradient)
        keys = [k for k in run64 if isinstance(k, str) and k.startswith(prefixes) and k in mapped64]
        return bool(keys) and judge_float64(run64, mapped64, keys=keys, loss=loss).status == "divergence"

    return parts(("param/", "state/"), "loss" in run64 and "loss" in mapped64) or parts(("grad/",), False)


def stand_in_apart(m: SideMapping, case: Case, theory_spec: Mapping[str, Any], held: Mapping[str, str | None],
                   own: Collection[str], own_schedule: Collection[str], kernels: Any = None) -> str | None:
    """What theory expects to differ between ``m``'s stand-in, as it runs for the plugin (:attr:`SideMapping.plain`),
    and the plugin itself (:func:`stand_in_leg`'s ``apart``: e.g. Keras' ``CosineDecay`` a step late in the built-in,
    the plugin's own rate on the curve), or ``None``; the free compare and ``--lockstep`` ask it alike."""
    from parity_tests.judging.theory import predict

    if not m.stand_in:
        return None
    plain_spec = m.plain.apply(case.replace(dtype=theory_spec["dtype"])).spec if m.plain else theory_spec
    differs = predict(dict(plain_spec), engine(m.runs_as), engine(m.side), held=dict(held), kernels=kernels,
                      own=own, own_schedule=own_schedule).expected
    return "; ".join(t.split(":")[0] for t in differs) or None


#: the words of the line of a pair decided by its stand-in's leg because the other side computes the case
#: (:func:`stand_in_leg`'s ``computes``)
CASE_COMPUTED = "the other side computes the case"
#: the stages (``localise.STAGES``) before the update where a stand-in's leg decides by ``computes`` (:func:`stand_in_leg`):
#: not the update (its own branch), nor the optimizer's state or the logged loss after it, nor a stage not found
_BEFORE_UPDATE = ("inputs", "forward", "loss", "device_grads", "combined_grads", "clip")


def kind_run(side: str, spec: Mapping[str, Any], rounding: Mapping[str, str | None], own: Collection[str] = (),
             own_schedule: Collection[str] = ()) -> SideMapping | None:
    """The built-in of the plugin ``side``'s kind (:data:`STAND_INS`) running the case as ``side`` runs it, or ``None``.

    What shows that a plugin computes the case as given (:func:`stand_in_leg`'s ``computes``): the
    plugin against this run, by the pair's rule, at parity. "As ``side`` runs it": with the plugin's
    own Keras roundings (``mapping_changes("optimizer")``, as :func:`choose_mapping`'s ``plain``),
    nothing else changed. ``None`` for a built-in (it computes the case by construction) and for
    an external model (no built-in runs it). ``changes`` and ``plain`` both hold those roundings,
    so that the run's key is its own and :func:`stand_in_apart` reads what theory expects between the two.
    """
    found = _declared(side)
    if found is None or found.kind == "builtin" or "external" in spec["model"]:
        return None
    runs_as = STAND_INS[(found.framework, found.parallel)]
    plain = (mapping_changes("optimizer", dict(spec), engine(runs_as), engine(side), rounding.get(side), own, own_schedule)
             if spec["optimizer"]["semantics"] in ("native", "tf") else None)
    if plain and all(k.startswith("optimizer.") and spec["optimizer"].get(k[len("optimizer."):], "none") == v
                     for k, v in plain.items()):
        plain = None
    return SideMapping(side, side, dict(plain or {}), runs_as, SideMapping(side, side, plain, runs_as) if plain else None)


def stand_in_leg(plain: Verdict, stage: Callable[[], str | None],
                 m: SideMapping, apart: str | None = None, leaky: bool = False,
                 computes: str | None = None) -> tuple[Verdict | None, str | None]:
    """What the stand-in's leg says of a residual judged through it: ``(decides, not_judged)``.

    ``plain``: the plugin ``m.side`` judged against its stand-in ``m.runs_as`` as it runs (the
    plugin's own roundings, :attr:`SideMapping.plain`), by the pair's rule; ``stage()``: where
    they part (``localise``'s stage), asked only when they do. The free compare
    (:meth:`_Judged.residual`) and ``--lockstep`` (each step's one-step runs) both decide by it:

    * ``(None, None)``: at parity (inconclusive, nothing moving, shows nothing): the stand-in computes what the plugin
      computes, and the mapped leg is the pair's residual;
    * ``(verdict, None)``: they part at the update, from the same gradient: the plugin's optimizer
      step is not the rule of its kind that theory predicted from (a torch port that decays every
      parameter), so no predicted optimizer difference explains its gap: that leg is the
      residual, a divergence naming the plugin;
    * ``(None, reason)``: they part before it (the loss, the gradients: a loss term no case field
      expresses): the stand-in computes another program, its mapped leg says nothing about the
      pair, and no residual is judged (``reason`` starts with :data:`NOT_EQUIVALENT`). Likewise
      where they part anywhere and theory predicts that they do (``apart``: its expected
      differences between the stand-in and the plugin, e.g. Keras' ``CosineDecay`` a step late in
      the built-in, the plugin's own rate on the curve): a known difference of the stand-in is not
      the plugin's fault, and the stand-in is no equivalent run;
    * ``(verdict, None)`` also where they part at the logged loss alone (``localise``'s stage
      ``record``: every parameter, and every gradient both recorded, agrees at every step by the
      pair's rule, and only the loss differs, a divergence): the stand-in trains as the plugin
      does (the parameters are the training's outcome: the same at every step is the same
      training, whatever each logs), so it is an equivalent run for everything the mapping
      judges, and the plugin logs a loss other than the loss of the step it trains on (the loss
      after the update, one micro-batch's, one rank's): a divergence naming its loss. A loss
      term the case cannot express (an L2 regularizer) changes the gradients too, so its
      parameters part as well (stage ``loss``): not this branch. Nor where a float64 run of
      the two computes its loss in float32 (``leaky``: ``precision_leak.loss_in_float32``, a
      ``tf.compat.v1.losses`` program): such a loss differs from the stand-in's by float32
      rounding with the parameters agreeing, which is no wrong loss.
    * ``(verdict, None)`` also where they part before the update (a divergence at a stage up to the
      clip; not one found after the update, or none found) and the other side
      ``m.other`` is shown to compute the case as given (``computes`` says why: a built-in, or a
      plugin at parity with the built-in of its kind as it runs, :func:`kind_run`), where theory
      predicts nothing between the stand-in and the plugin (``apart``) and no float64 run of the
      two computes its loss in float32 (``leaky``). The built-ins of the two kinds compute the
      case, and their gap is what theory predicts from the case; ``m.other`` computes what its
      built-in computes; ``m.side`` does not compute what its built-in computes. So the pair's
      gap is not the built-ins' gap: ``m.side`` computes another program than the case that both
      built-ins and ``m.other`` compute, a difference of the pair. This is what a bug inside the
      mapped field needs (the sum reduction's ``weighting: sum`` on a program that ignores
      ``by_size``): no mapping of the pair can show it, since the mapping replaces the very value
      the program gets wrong. A loss term the case cannot express on both sides (issue 35's L2
      ports) keeps the other side apart from its built-in too: not this branch.
    """
    if plain.status == "parity" or float64_shown(plain):
        return None, None
    if apart and plain.status != "inconclusive":  # the stand-in differs by what theory predicts: not equivalent
        return None, (f"{NOT_EQUIVALENT}: {m.runs_as}, standing in for {m.side}, does not compute what {m.side}"
                      f" computes, as predicted ({apart}; {plain.status} by {plain.rule}, gap {plain.gap:.3g})")
    # inconclusive is no showing: where nothing moves the vacuity rule reports a loss that differs (a loss term
    # the stand-in lacks: the L2 program at lr 1e-7, whose stand-in's mapped leg then made a divergence)
    where = stage() if plain.status != "inconclusive" else None
    if where == "update":
        return dataclasses.replace(plain, detail=(
            f"{m.side} against {m.runs_as}, the built-in of its kind, from the same gradient: its update"
            f" is not the optimizer rule theory predicts for it: {plain.detail}")), None
    if where == "record" and plain.status == "divergence" and not leaky:
        return dataclasses.replace(plain, detail=(
            f"{m.side} against {m.runs_as}, the built-in of its kind: every parameter agrees at every step and only"
            f" the logged loss differs, so {m.runs_as} trains as {m.side} does and {m.side} logs a loss other than"
            f" the loss of the step it trains on (the loss after the update, one micro-batch's or one rank's?):"
            f" {plain.detail}")), None
    if computes and plain.status == "divergence" and not leaky and where in _BEFORE_UPDATE:
        return dataclasses.replace(plain, detail=(
            f"{m.side} against {m.runs_as}, the built-in of its kind running the case as given: they part at {where},"
            f" before any update, while {CASE_COMPUTED} ({computes}); so {m.side} does not compute the case the"
            f" other side computes, and the predicted difference does not explain the pair's gap: {plain.detail}")), None
    first = plain.detail.splitlines()[0] if plain.detail else ""
    # an error (both non-finite at the same place, an array missing) shows no difference, but no equivalence either
    does = "cannot be shown to compute" if plain.status in ("error", "inconclusive") else "does not compute"
    return None, (f"{NOT_EQUIVALENT}: {m.runs_as}, standing in for {m.side}, {does} what {m.side}"
                  f" computes ({plain.status} by {plain.rule}, gap {plain.gap:.3g} against {plain.bound:.3g}: {first})")


def float64_shown(plain: Verdict) -> bool:
    """A float32 leg ``inconclusive`` only because its float32 runs move nothing beyond their noise, while its float64
    runs move beyond the float64 bound and agree within it (``rules.vacuity.Vacuity``: ``float64_runs``).

    A mapping changes what the float64 runs compute (Keras' float32 betas made exact: 1.3e-2 of ``1 - beta`` at
    0.999999), and a float32 case is decided by its float64 runs first: stand-in and plugin agreeing there, where
    the parameters move, is the showing that the stand-in computes what the plugin computes. Measured (the
    10,000-pair run's s6-0459, keras_model against concat_loss, Adam lr 1e-7, betas 0.999999, float32): the
    stand-in ``tf.towers`` and ``keras_model`` agree to 0 in float64 (moving 2.5e-7), the pair parts by 1.01e-9 there
    (Keras' float32 betas, the known difference): before, the leg counted as no showing and the pair stayed a
    divergence with the residual not judged."""
    f = plain.float64_runs
    return plain.status == "inconclusive" and f is not None and f.status == "parity"


def residual_unjudged(final: Verdict, not_judged: str | None) -> Verdict:
    """``final`` (``pair.resolve``'s verdict) saying, once and with why, that no residual was judged (:func:`stand_in_leg`).

    Only on a verdict that is not ``parity``, ``inconclusive`` or ``error``; it replaces
    ``pair.resolve``'s own line for a pair without a mapping ("no side ... can map it away").
    """
    if not not_judged or final.status in ("parity", "inconclusive", "error"):
        return final
    kept = tuple(u for u in final.unjudged if not u.startswith("whether the predicted difference explains"))
    return dataclasses.replace(final, unjudged=(*kept, f"whether the predicted difference explains the whole gap: {not_judged}"))

