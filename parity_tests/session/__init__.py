"""Orchestration: one comparison from the case to the verdicts, above running and judging.

``comparison`` runs the implementations (``running.harness``), reruns them perturbed
and mapped, and judges each pair through ``judging.pair`` (``judge_sides`` then
``resolve``: every rule and guard); ``lockstep`` judges one-step runs through the
same two functions; ``spread`` measures a non-deterministic plugin's run-to-run
spread by rerunning it; ``progress`` shows long work. Nothing below imports this
package.
"""
