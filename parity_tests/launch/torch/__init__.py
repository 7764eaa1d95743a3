"""The torch reference under ``torchrun``: one case on N ranks spread over one or several machines.

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \\
        -m parity_tests.launch.torch case.json --impl torch.ddp --out run.npz
    tfpar compare case.json --impls tf.towers,recorded:run.npz

The same job functions as the warm pool (``torchref.ddp.train_rank`` and the
other combine rules' through ``torchref.run.job_function``, and
``torchref.plugin.run_plugin_rank`` for ``@torchref.plugin.distributed``
plugins) run with a :class:`~torchref.pool.RankContext` built from
torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); no launcher of our own.
Rank 0 writes the trajectory and its manifest exactly as ``tfpar run`` does
(plus a ``launch`` object: nodes, ranks, hosts, backend, interface), so the
file is a recorded run (docs/testing-your-code.md, docs/cluster.md). Every rank takes part in the
replicas-in-sync check: each rank digests its parameters before step 1 and
after every step, and rank 0 reports the first step, rank and parameter that
is not bitwise equal to its own (a finding: exit 1, as ``tfpar run``).

Backends: the built-in ``torch.ddp`` trains on the CPU, so its collectives
are gloo's on every machine (it is the reference: bit for bit the warm
pool's trajectory). A plugin gets NCCL where CUDA is available
(``--backend auto``), gloo otherwise; its ``run.group`` is the default group.

Interfaces: gloo and NCCL bind to ``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME`` when the user sets them, else to the interface that
routes to ``MASTER_ADDR`` (loopback for ``127.0.0.1``), never to whatever the
host name resolves to.

Failures: one line per node names the rank that failed first with its node
(``node 1, rank 3 (local rank 1, host h, pid p) raised at step 2: ...``), see
:mod:`parity_tests.launch.torch.faults`. Each worker's exit status: 0 written; 1 a rank
failed or the replicas diverged; 2 bad input (one line naming the field); 130
Ctrl-C. ``torchrun`` itself exits 1 when any worker exits non-zero (its
summary shows the workers' codes).

This module imports ``parity_tests.contract`` and the manifest writer
(``parity_tests.running``), which import neither TensorFlow nor torch
(``parity_tests/tests/test_launch.py`` checks it): the torch side's entry point
validates the case exactly as the tool does, and TensorFlow never loads.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook

from parity_tests.contract.arguments import OneLineParser, positive_seconds
from parity_tests.launch.torch.faults import FaultBoard, Where, hostname
from parity_tests.launch.torch.netif import route_interface
from parity_tests.protocol import settings
from parity_tests.protocol.errors import CaseError
from torchref.plugin import PluginInputError, PluginRaised, run_plugin_rank
from torchref.pool import RankContext
from torchref.run import job_function

__all__ = ["main", "build_parser", "TorchrunEnv", "torchrun_env", "ParamDigests"]

_NEEDED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class TorchrunEnv:
    """What torchrun tells each worker (environment variables), checked.

    Attributes:
        rank, world_size, local_rank, node: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
            ``GROUP_RANK`` (the node's index, ``--node-rank``).
        master_addr, master_port: the rendezvous store torchrun runs.
        run_id: ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_RESTART_COUNT`` (the store key prefix).
    """

    def __init__(self, environ: Mapping[str, str]) -> None:
        for key in _NEEDED:
            if not environ.get(key):
                raise CaseError(key, "set by torchrun: run this module as 'torchrun ... -m parity_tests.launch.torch CASE"
                                     " --impl torch.ddp --out run.npz'")
        ints = {}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "GROUP_RANK"):
            text = environ.get(key, "0")
            if not text.isdigit():
                raise CaseError(key, "a non-negative integer (torchrun sets it)", text)
            ints[key] = int(text)
        self.rank, self.world_size, self.local_rank = ints["RANK"], ints["WORLD_SIZE"], ints["LOCAL_RANK"]
        self.node, self.master_port = ints["GROUP_RANK"], ints["MASTER_PORT"]
        self.master_addr = environ["MASTER_ADDR"]
        self.run_id = f"{environ.get('TORCHELASTIC_RUN_ID', 'none')}/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        if not self.rank < self.world_size:
            raise CaseError("RANK", f"below WORLD_SIZE = {self.world_size}", self.rank)


def torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv:
    """:class:`TorchrunEnv` of ``environ`` (default ``os.environ``); :class:`CaseError` when not under torchrun."""
    return TorchrunEnv(os.environ if environ is None else environ)


def _digest(a: np.ndarray) -> str:
    h = hashlib.blake2b(f"{a.dtype.str}{a.shape}".encode(), digest_size=16)
    h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


class ParamDigests:
    """Digests of the reference model's parameters before step 1 and after every optimizer step.

    ``torchref.ddp.train_rank`` records parameters on rank 0 only; the other
    ranks' copies are observed here without touching the training loop: a
    global forward pre-hook finds the ``CaseModel`` (row 0, the parameters
    before step 1, at its first forward) and a global optimizer step post-hook
    digests every parameter after each ``optimizer.step()`` (rows 1..steps).
    ``rows[k]``: ``{canonical name: digest}``, as ``torchref.plugin.Run.records`` gives for plugins.
    """

    def __init__(self) -> None:
        from torchref.models import CaseModel

        self._kind = CaseModel
        self.model: Any = None
        self.rows: list[dict[str, str]] = []

    def _row(self) -> dict[str, str]:
        return {k: _digest(p.detach().cpu().numpy()) for k, p in self.model.canonical().items()}

    def _forward(self, module: torch.nn.Module, _args: Any) -> None:
        if self.model is None and isinstance(module, self._kind):
            self.model = module
            self.rows.append(self._row())

    def _step(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        if self.model is not None:
            self.rows.append(self._row())

    def __enter__(self) -> ParamDigests:
        self._handles = [register_module_forward_pre_hook(self._forward),
                         register_optimizer_step_post_hook(self._step)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()


class _Parser(OneLineParser):
    help_hint = "python -m parity_tests.launch.torch --help"


def build_parser() -> argparse.ArgumentParser:
    """The command line each rank parses (the same on every rank)."""
    p = _Parser(prog="torchrun ... -m parity_tests.launch.torch",
                description="Run the torch reference (or a torch plugin) on torchrun's ranks; rank 0 writes the trajectory.")
    p.add_argument("case", help="path to case.json (readable on every node)")
    p.add_argument("--impl", default="torch.ddp", help="torch.ddp (default) or a @torchref.plugin.distributed plugin FILE.py:FUNCTION")
    p.add_argument("--out", required=True, help="trajectory file rank 0 writes (.npz), its manifest beside it")
    p.add_argument("--timeout", type=positive_seconds, default=60.0, help="seconds a collective may wait before its rank fails (default 60)")
    p.add_argument("--start-timeout", type=positive_seconds, default=300.0, help="seconds to wait for every rank to join (default 300)")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: gloo for torch.ddp (the CPU reference), NCCL for a plugin where CUDA is available")
    return p


def _validate(args: argparse.Namespace, env: TorchrunEnv) -> tuple[Any, str, Any]:
    """(case, implementation name, plugin target or None); :class:`CaseError` on bad input."""
    from parity_tests.contract.case import load_case
    from parity_tests.running.plugins import is_plugin_name, resolve_plugin

    out = Path(args.out)
    if out.suffix != ".npz":
        raise CaseError("--out", "a file name ending in .npz", args.out)
    if env.rank == 0 and not out.parent.exists():
        raise CaseError("--out", f"a file in an existing folder on node {env.node} (rank 0 writes it); {out.parent} does not exist")
    case = load_case(args.case)
    target = None
    if is_plugin_name(args.impl):
        target = resolve_plugin(args.impl, "--impl")
        if target.kind != "distributed":
            raise CaseError("--impl", "torch.ddp or a @torchref.plugin.distributed plugin (torchrun starts N ranks)",
                            f"{args.impl} ({target.kind})")
    elif args.impl != "torch.ddp":
        raise CaseError("--impl", "torch.ddp or a @torchref.plugin.distributed plugin FILE.py:FUNCTION"
                                  " (TensorFlow implementations run with tfpar; torch.single needs no torchrun)", args.impl)
    if target is None and "external" in case.spec["model"]:
        raise CaseError("model", "a layer list for torch.ddp (an external model runs only on plugins)",
                        {"external": case.spec["model"]["external"]})
    if target is not None and case.spec["data"].get("order", "split") != "split":
        raise CaseError("data.order", f"split for the plugin {args.impl}", case.spec["data"]["order"])
    dtypes = target.dtypes if target is not None else ("float32", "float64")
    if case.spec["dtype"] not in dtypes:
        raise CaseError("dtype", f"one of {', '.join(dtypes)} for {args.impl} (the dtypes it declares)", case.spec["dtype"])
    if case.devices != env.world_size:
        raise CaseError("parallel.devices", f"{env.world_size} (torchrun's world size: --nnodes x --nproc-per-node)", case.devices)
    if args.backend == "nccl" and target is None:
        raise CaseError("--backend", "gloo or auto for torch.ddp (the reference trains on the CPU; NCCL serves plugins"
                                     " that put their model on a GPU)", args.backend)
    return case, args.impl, target


def _bind_interfaces(env: TorchrunEnv) -> str:
    """Set ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` unless the user did; return gloo's."""
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    if not iface:
        try:
            iface, _ = route_interface(env.master_addr, env.master_port)
        except OSError as e:
            raise CaseError("MASTER_ADDR", f"an address this machine can reach ({e}); or set GLOO_SOCKET_IFNAME",
                            env.master_addr) from None
        os.environ["GLOO_SOCKET_IFNAME"] = iface
    os.environ.setdefault("NCCL_SOCKET_IFNAME", iface.split(",")[0])
    return iface


def _train(case: Any, impl: str, target: Any, ctx: RankContext, gloo: Any) -> tuple[Any, list[dict[str, str]]]:
    """Run this rank's part; return (rank 0's result or this rank's records, this rank's parameter digests)."""
    payload = case.payload()
    if target is not None:
        job = {"location": target.location, "kind": "distributed", "payload": payload}
        records = run_plugin_rank(ctx, job)
        return records, records["digests"]
    fn = job_function(payload, "torch.ddp")
    with ParamDigests() as digests:
        result = fn(RankContext(ctx.rank, ctx.world_size, gloo, ctx.timeout), payload)
    return result, digests.rows


def _write(case: Any, impl: str, target: Any, result: Any, gathered: list[dict[str, Any]], out: Path,
           launch: dict[str, Any]) -> tuple[int, str]:
    """Rank 0: assemble, check the replicas, write trajectory and manifest; (exit status, line)."""
    from parity_tests.protocol.trajectory import Trajectory, save_trajectory
    from parity_tests.running.manifest import manifest_path, write_manifest
    from parity_tests.running.plugins import assemble, replica_divergence
    from parity_tests.running.provenance import build_manifest

    traj = Trajectory(assemble(result, case.spec, case.init, impl) if target is not None else result)
    checked = case.spec["parallel"]["combine"] in ("grad_mean", "loss_mean") or target is not None
    if checked:  # param_mean and async: the replicas differ between averages by design
        finding = replica_divergence([{"digests": g["digests"]} for g in gathered], impl)
        if finding:
            traj.findings.append(finding)
    save_trajectory(out, traj)
    manifest = build_manifest(case, impl, traj, out.name)
    manifest["launch"] = {**launch, "replicas_checked": checked, "ranks": [g["where"] for g in gathered]}
    mpath = write_manifest(manifest_path(out), manifest)
    nodes = len({g["where"]["node"] for g in gathered})
    line = (f"{impl}: {case.spec['steps']} steps of {case.name} on {nodes} node(s), world size {len(gathered)}"
            f" ({launch['backend']}, interface {launch['interface']}) -> {out} (final loss {float(traj['loss'][-1]):.6g});"
            f" manifest {mpath}")
    for f in traj.findings:
        line += f"\nfinding: {impl}: {f}"
    return (1 if traj.findings else 0), line


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m parity_tests.launch.torch`` on each torchrun worker; returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
        settings.check()
        env = torchrun_env()
        case, impl, target = _validate(args, env)
        iface = _bind_interfaces(env)
    except CaseError as e:
        if os.environ.get("LOCAL_RANK", "0") == "0":  # every rank finds the same: one line per node
            print(f"parity_tests.launch.torch: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    backend = args.backend if args.backend != "auto" else (
        "nccl" if target is not None and torch.cuda.is_available() else "gloo")
    from torchref.determinism import configure

    configure()  # as in the warm pool: the manifest's determinism settings
    me = Where(env.node, env.rank, env.local_rank, hostname(), os.getpid())
    td = timedelta(seconds=args.timeout)
    try:
        if backend == "nccl":
            torch.cuda.set_device(env.local_rank)
        # Ranks start seconds apart: join under the start timeout, then switch to the collective timeout
        start_td = timedelta(seconds=args.start_timeout)
        dist.init_process_group(backend, timeout=start_td)
        gloo = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=start_td)
        board = FaultBoard((env.master_addr, env.master_port), f"parity_tests.launch.torch/{env.run_id}/", me,
                           env.world_size, args.timeout, impl)
        # a rank still starting up (seconds behind on a busy machine) is not a hung one: meet
        # here under the start timeout, so the short collective timeout measures training only
        dist.barrier(group=gloo)
        for group in {dist.group.WORLD, gloo}:
            dist.distributed_c10d._set_pg_timeout(td, group)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        print(f"parity_tests.launch.torch: {me.name()} could not join the {backend} group at {env.master_addr}:{env.master_port}"
              f" within {args.start_timeout:g} s: {last}", file=sys.stderr)
        return 1
    with ExitStack() as stack:
        stack.callback(board.stop)
        ctx = RankContext(env.rank, env.world_size, dist.group.WORLD, args.timeout)
        try:
            result, digests = _train(case, impl, target, ctx, gloo)
        except KeyboardInterrupt:
            return 130
        except Exception as e:
            # torchrun sends SIGTERM to this node's other workers as soon as one exits: finish
            # naming the cause first (seconds; torchrun sends SIGKILL after 30 s anyway)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if isinstance(e, PluginRaised):  # the plugin's own error, or a collective failing under it
                if e.frames:  # the user's own frames, on this rank's stderr
                    print(e.frames, end="", file=sys.stderr, flush=True)
                kind, code = board.report(e.line if e.step else f"{e.line} ({e.when})", e.step or None), 1
            elif isinstance(e, PluginInputError):
                kind, code = board.report(str(e)), 2
            else:
                kind, code = board.report(e), 1
            board.announce_failure(kind)
            return code
        try:
            mine = {"where": asdict(me), "digests": digests}
            gathered: list[Any] | None = [None] * env.world_size if env.rank == 0 else None
            dist.gather_object(mine, gathered, dst=0, group=gloo)
            status: list[Any] = [None]
            if env.rank == 0:
                launch = {"launcher": "torchrun", "backend": backend, "interface": iface,
                          "master": f"{env.master_addr}:{env.master_port}", "world_size": env.world_size}
                try:
                    status[0] = _write(case, impl, target, result, gathered, Path(args.out), launch)
                except CaseError as e:
                    status[0] = (2, f"parity_tests.launch.torch: error: {e}")
                except OSError as e:
                    status[0] = (1, f"parity_tests.launch.torch: could not write {args.out}: {e}")
            dist.broadcast_object_list(status, src=0, group=gloo)  # every rank (and torchrun call) exits alike
        except KeyboardInterrupt:
            return 130
        except Exception as e:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            board.announce_failure(board.report(e))
            return 1
        code, line = status[0]
        if env.rank == 0:
            print(line, file=sys.stdout if code == 0 else sys.stderr)
        elif env.local_rank == 0:  # one line on every other node too: its torchrun call says how the run ended
            print(f"parity_tests.launch.torch: node {env.node}: rank 0 reported: {line}", file=sys.stdout if code == 0 else sys.stderr)
        board.stop()
        dist.destroy_process_group()
        return code
