"""The ``tfpar`` command.

    tfpar run CASE --impl IMPL --out FILE.npz
    tfpar compare CASE [--impls A,B,...] [--report DIR]
    tfpar matrix [--out DIR] [--resume] [--impls PLUGIN,...]
    tfpar replay MANIFEST
    tfpar --version

``-q``/``--quiet`` drops the progress display and the notes on stderr (the verdict table and
errors stay); ``-v``/``--verbose`` adds the library's debug messages. The library writes its
messages to the ``logging`` logger ``"tfpar"`` (children ``tfpar.session``, ...) and never
configures logging itself; this command puts one handler on that logger for its own run.

Exit status: 0 ok (compare: every pair at parity or an expected difference;
matrix: every expected result held; replay: bit-identical); 1 a divergence or an
unexpected parity was found (compare; run: DDP replicas out of sync; replay: an
array differs), an expected result did not hold (matrix, also when an
implementation failed there); 2 bad input (one line naming the field); 3 nothing
could be judged and nothing wrong was shown (compare: the worst pair is
inconclusive or an error; any command but matrix: an implementation failed);
130 Ctrl-C, 143 SIGTERM.

This module's top level imports neither TensorFlow nor torch: spawned torch
workers re-import the parent's main module, and must not pay for TensorFlow.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parity_tests.contract.arguments import OneLineParser, positive_seconds
from parity_tests.protocol import settings
from parity_tests.protocol.errors import CaseError

if TYPE_CHECKING:
    from parity_tests.contract.case import Case

__all__ = ["main", "entry", "build_parser"]


class _Parser(OneLineParser):
    help_hint = "tfpar --help"


def _verbosity(p: argparse.ArgumentParser, default: Any) -> None:
    """``-q``/``--quiet`` and ``-v``/``--verbose``, accepted before and after the command's name."""
    how = p.add_mutually_exclusive_group()
    how.add_argument("-q", "--quiet", action="store_true", default=default,
                     help="no progress display and no notes on stderr: the verdicts, the report's path and errors only")
    how.add_argument("-v", "--verbose", action="store_true", default=default,
                     help="also the library's debug messages (each run as it starts and ends)")


def build_parser() -> argparse.ArgumentParser:
    from parity_tests.running.environment import tool_version

    p = _Parser(prog="tfpar", description="Prove or disprove that TensorFlow tower training computes the same updates as PyTorch DDP.")
    p.add_argument("--version", action="version", version=f"tfpar {tool_version()}")
    p.add_argument("--timeout", type=positive_seconds, default=None, help="seconds a torch job may go without progress (a training step or a phase of one, a row written to a spill file) before its ranks are declared hung (default 60)")
    _verbosity(p, False)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    r = sub.add_parser("run", help="run one implementation and write its trajectory")
    r.add_argument("case", help="path to case.json")
    r.add_argument("--impl", required=True, help="a built-in (tf.towers, tf.single, tf.v1, tf.mirrored, torch.ddp, torch.single), "
                   "a plugin FILE.py:FUNCTION or package.module:FUNCTION, or an installed name")
    r.add_argument("--out", required=True, help="trajectory file to write (.npz)")

    c = sub.add_parser("compare", help="run several implementations and judge parity")
    c.add_argument("case", help="path to case.json")
    c.add_argument("--impls", default="tf.towers,torch.ddp,tf.single,torch.single", help="comma-separated; the first is the reference (default: %(default)s)")
    c.add_argument("--report", default=None, help="folder for report.md, report.json, gap plot and trajectories")
    c.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="write TensorBoard event files: each implementation's loss, each pair's gap per parameter and its bound")
    c.add_argument("--full", action="store_true",
                   help="with --report: write every run's full trajectory, whatever its size (default: up to 1 GiB in all)")
    c.add_argument("--junit", default=None, metavar="FILE",
                   help="also write JUnit XML for CI: one test case per pair, a failure for a divergence or an "
                        "unexpected parity, an error for an inconclusive pair or a failed implementation")
    c.add_argument("--lockstep", action="store_true",
                   help="also judge every step from the reference's state of the step before (docs/lockstep.md); "
                        "exit status from the worst verdict printed (a free inconclusive excepted)")

    m = sub.add_parser("matrix", help="the built-in scenario matrix, written as a report")
    m.add_argument("--out", default="report", help="report folder (default: %(default)s)")
    m.add_argument("--quick", action="store_true", help="a smaller matrix (1 and 2 devices, float64 only)")
    m.add_argument("--resume", action="store_true", help="keep the rows an interrupted run already finished in --out")
    m.add_argument("--impls", default="", help="more implementations (plugins FILE.py:FUNCTION, installed names) judged against tf.towers in every row")
    m.add_argument("--junit", default=None, metavar="FILE", help="also write JUnit XML for CI: one test case per pair of every row")

    rp = sub.add_parser("replay", help="re-run a recorded run and check it bit for bit")
    rp.add_argument("manifest", help="a .manifest.json written beside a trajectory")
    for each in (r, c, m, rp):
        _verbosity(each, argparse.SUPPRESS)
    return p


def _cmd_run(args: argparse.Namespace) -> int:
    from parity_tests.contract.case import load_case
    from parity_tests.protocol.trajectory import save_trajectory
    from parity_tests.running.harness import run_impl

    out = Path(args.out)
    if out.suffix != ".npz":
        raise CaseError("--out", "a file name ending in .npz", args.out)
    if out.parent and not out.parent.exists():
        raise CaseError("--out", f"a file in an existing folder; {out.parent} does not exist")
    case = load_case(args.case)
    from parity_tests.running.harness import parse_impls

    impl = parse_impls(args.impl, "--impl")
    if len(impl) != 1:
        raise CaseError("--impl", "exactly one implementation", args.impl)
    from parity_tests.judging.compare import first_nonfinite
    from parity_tests.running.manifest import manifest_path, write_manifest
    from parity_tests.running.provenance import build_manifest

    traj = run_impl(case, impl[0])
    save_trajectory(out, traj)
    mpath = write_manifest(manifest_path(out), build_manifest(case, impl[0], traj, out.name))
    print(f"{impl[0]}: {case.spec['steps']} steps of {case.name} -> {out} (final loss {float(traj['loss'][-1]):.6g}); manifest {mpath}")
    bad = first_nonfinite(traj, impl[0])
    if bad:
        print(f"warning: {bad}", file=sys.stderr)
    findings = getattr(traj, "findings", [])
    for line in findings:
        print(f"finding: {impl[0]}: {line}", file=sys.stderr)
    return 1 if findings else 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from parity_tests.contract.case import load_case
    from parity_tests.reporting.report import write_case_report
    from parity_tests.running.backends import RunError
    from parity_tests.running.harness import parse_impls
    from parity_tests.session.comparison import compare_case

    impls = parse_impls(args.impls)
    if len(impls) < 2:
        raise CaseError("--impls", "at least two implementations to compare", args.impls)
    case = load_case(args.case)
    from parity_tests.running.harness import check_refusals, prestart_torch

    check_refusals(case, impls)  # every implementation's refusal before any of them runs (or the pool starts)
    from parity_tests.session.noise import check_recorded_mix

    check_recorded_mix(case, impls)  # two recorded float32 runs beside runnable ones: no rule to judge their pair
    if args.tensorboard:  # TensorFlow without tensorboard fails only at its first tf.summary, after every run
        from parity_tests.running.frameworks import require

        require("tensorboard", "--tensorboard", "--tensorboard")
    prestart_torch(case, impls)  # the torch ranks start while TensorFlow imports
    try:
        if args.lockstep:
            return _lockstep(case, impls, args)
        from parity_tests.session.noise import noise_or_bug_all, recorded_runs, summary_of

        if recorded_runs(case, impls):  # recorded float32 runs only: noise or bug, against the stand-ins' floors
            from parity_tests.judging.verdict import exit_status
            from parity_tests.running.harness import run_impl

            noise = noise_or_bug_all(case, impls, lambda c, n: run_impl(c, n))
            print(summary_of(noise))
            return exit_status([r.status for r in noise])
        result = compare_case(case, impls, progress=not args.quiet)
    except RunError as e:  # no verdict: in CI every pair reads as an error, with the line the command prints
        if args.junit:
            from parity_tests.reporting.junit import failed_run_cases, write_junit

            write_junit(args.junit, failed_run_cases(case.name, impls, f"run failed: {e}"), name="tfpar compare")
        raise
    print(result.summary())
    if args.report:
        path = write_case_report(result, Path(args.report), full=args.full)
        print(f"report: {path}")
    if args.tensorboard:
        from parity_tests.reporting.tensorboard import write_tensorboard

        print(f"tensorboard: {write_tensorboard(result, Path(args.tensorboard))} (tensorboard --logdir there)")
    if args.junit:
        from parity_tests.reporting.junit import cases_of, write_junit

        print(f"junit: {write_junit(args.junit, cases_of(result), name='tfpar compare')}")
    return result.exit_status


def _lockstep(case: Case, impls: list[str], args: argparse.Namespace) -> int:
    """``compare --lockstep``: the free comparison and lockstep's per-step verdicts; the exit status (and
    ``--junit``'s test cases) from the worst verdict printed: lockstep's, and the free comparison's that say
    something is wrong (``LockstepResult.exit_status``; a free inconclusive is lockstep's to resolve)."""
    from parity_tests.reporting.report import write_case_report
    from parity_tests.session.lockstep import check_lockstep, lockstep_compare

    check_lockstep(case, impls)  # before anything runs
    say = None if args.quiet else (lambda label: print(f"  {label}", file=sys.stderr, flush=True))
    result = lockstep_compare(case, impls, progress=say)
    print(result.summary())
    if args.report:
        print(f"report: {write_case_report(result.free, Path(args.report), lockstep=result, full=args.full)}")
    if args.tensorboard:
        from parity_tests.reporting.tensorboard import write_tensorboard

        print(f"tensorboard: {write_tensorboard(result.free, Path(args.tensorboard))} (tensorboard --logdir there)")
    if args.junit:
        from parity_tests.reporting.junit import lockstep_cases_of, write_junit

        print(f"junit: {write_junit(args.junit, lockstep_cases_of(result), name='tfpar compare --lockstep')}")
    return result.exit_status


def _cmd_matrix(args: argparse.Namespace) -> int:
    from parity_tests.reporting.matrix import run_matrix
    from parity_tests.running.harness import parse_impls

    extra = parse_impls(args.impls) if args.impls.strip() else []
    return run_matrix(Path(args.out), quick=args.quick, resume=args.resume, extra=extra, progress=not args.quiet,
                      junit=Path(args.junit) if args.junit else None)


def _cmd_replay(args: argparse.Namespace) -> int:
    from parity_tests.running.manifest import load_manifest, replay_name
    from parity_tests.running.provenance import replay, run_gpu_facts, version_drift

    manifest = load_manifest(args.manifest)
    same, line = replay(manifest)
    # after the run: the replayed framework reports its own CUDA and cuDNN (a torch run: from its pool rank)
    drift = version_drift(manifest, now_gpu=run_gpu_facts(replay_name(manifest)))
    if drift:
        print(drift)
    print(line)
    return 0 if same else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tfpar`` console script; returns the exit status."""
    previous = _on_signals()
    handler = None
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # --version, --help: printed; the status is returned like any other
            return e.code if isinstance(e.code, int) else 0
        handler = _StderrHandler(logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO)
        settings.check()  # a bad TFPAR_* variable: one line, exit 2, before any work
        from parity_tests.running.backends import RunError, set_pool_timeout

        set_pool_timeout(args.timeout)
        command = {"run": _cmd_run, "compare": _cmd_compare, "matrix": _cmd_matrix, "replay": _cmd_replay}[args.command]
        try:
            return command(args)
        except RunError as e:
            if _signalled:  # a run that failed because the signal broke into it (TensorFlow's own
                raise _signalled[-1]() from e  # bookkeeping asserts): reported as the signal
            print(f"tfpar: run failed: {e}", file=sys.stderr)
            frames = getattr(e, "frames", "")
            if frames:  # a plugin raised: the user's own frames, after the one line
                print(frames, end="" if frames.endswith("\n") else "\n", file=sys.stderr)
            # an implementation failed: nothing could be judged (the matrix: an expected result did not hold)
            return 1 if args.command == "matrix" else 3
    except CaseError as e:
        print(f"tfpar: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tfpar: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("tfpar: terminated", file=sys.stderr)
        return 143
    finally:
        if "torchref.pool" in sys.modules:
            sys.modules["torchref.pool"].shutdown_pool()
        if "parity_tests.running.tf_worker" in sys.modules:  # the server TensorFlow plugins run from
            sys.modules["parity_tests.running.tf_worker"].shutdown_worker()
        if "parity_tests.protocol.rows" in sys.modules:  # the runs' spilled rows (docs/memory.md): gigabytes
            sys.modules["parity_tests.protocol.rows"].remove_spill_root()
        if handler is not None:
            handler.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous[0])
            signal.signal(signal.SIGINT, previous[1])


class _StderrHandler(logging.StreamHandler):
    """The command's handler on the ``"tfpar"`` logger: each message as a line of stderr, as the
    command printed it before it logged. Writes to the ``sys.stderr`` of the moment (pytest's
    capture, a redirection made after start-up). :meth:`close` takes it off again and restores the
    logger's level, so a program that calls :func:`main` twice does not print each message twice."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))
        self._logger = logging.getLogger("tfpar")
        self._level = self._logger.level
        self._logger.setLevel(level)  # the logger's, not the root's: the library never touches the root logger
        self._logger.addHandler(self)

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ sets it; the property reads sys.stderr
        pass

    def close(self) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)
        super().close()


class Terminated(BaseException):
    """SIGTERM (``kill``, a scheduler's time limit) arrived: stop as Ctrl-C does, cleaning up."""


#: the exception of each SIGINT / SIGTERM this command received (an interrupted TensorFlow step can
#: end in an error of its own, e.g. ``tf_stack``'s "Concurrent access?" assertion, not in the signal's)
_signalled: list[type[BaseException]] = []


def _on_signals() -> Any:
    """SIGTERM raises :class:`Terminated`, SIGINT ``KeyboardInterrupt``, both noted in :data:`_signalled`.

    Only in the main thread; returns the previous handlers (``None`` elsewhere).
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    _signalled.clear()

    def stop(signum: int, frame: Any) -> None:
        if _in_finaliser(frame):
            # raised here, the exception would be printed and dropped ("Exception ignored in:
            # ConcreteFunction.__del__", seen in a fresh-clone run of test_interrupt: the matrix
            # went on). Send the signal again in 10 ms, and again, until it lands after the
            # finaliser has returned (sent from here, at once, it would run this handler again
            # from inside this handler, recursively)
            again = threading.Timer(0.01, os.kill, (os.getpid(), signum))
            again.daemon = True
            again.start()
            return
        kind = Terminated if signum == signal.SIGTERM else KeyboardInterrupt
        _signalled.append(kind)
        raise kind()

    return signal.signal(signal.SIGTERM, stop), signal.signal(signal.SIGINT, stop)


def _in_finaliser(frame: Any) -> bool:
    """True when ``frame`` runs inside a finaliser (``__del__``, a ``weakref`` callback), where
    Python prints an exception and drops it instead of raising it."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or code.co_filename == weakref.__file__:
            return True
        frame = frame.f_back
    return False


def entry() -> None:
    """The ``tfpar`` console script: :func:`main`, then exit with its status.

    After Ctrl-C the process ends at once when a thread it did not start is
    still running: TensorFlow's ``MirroredStrategy`` traces a step by running
    each replica in a non-daemon thread (``mirrored_run._MirroredReplicaThread``),
    and a replica interrupted mid-trace waits forever, so the interpreter would
    hang at exit joining it. By then :func:`main` has shut the DDP pool down and
    every file was written atomically; only the streams need flushing.
    """
    code = main()
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    if code in (130, 143) and others:
        if "torchref.pool" in sys.modules:  # atexit will not run: the forkserver's socket folder goes now
            sys.modules["torchref.pool"].remove_socket_folder()  # (the server itself leaves with us)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    entry()
