"""`verl-speco-draft-train`: normalise single/multi-node arguments and start the trainer.

1 node x 1 process runs in this process (`verl_speco.train.entry`); N processes or M nodes run
`torch.distributed.run` (`--standalone`, or a c10d / static rendezvous), arguments falling back to
NNODES, NPROC_PER_NODE, NODE_RANK, MASTER_ADDR, MASTER_PORT, RDZV_ENDPOINT, RDZV_ID. `--dry-run`
prints the exact command. Everything else is a Hydra override; the config and its inputs are checked
before torchrun starts (a user error: one line `verl-speco-draft-train: error: ...`, exit status 2)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Mapping, Sequence

from verl_speco.train.compose import DEFAULT_CONFIG_NAME, load_config
from verl_speco.train.entry import config_parser

ENTRY_MODULE = "verl_speco.train.entry"
DEFAULT_PORT = 29500


class LaunchError(ValueError):
    """The node / process arguments are incomplete or inconsistent."""


def build_parser() -> argparse.ArgumentParser:
    parser = config_parser("verl-speco-draft-train", __doc__ or "")
    g = parser.add_argument_group("processes and nodes (torchrun)")
    g.add_argument("--nnodes", type=int, default=None, help="number of nodes (env NNODES, default 1)")
    g.add_argument("--nproc-per-node", default=None,
                   help="processes per node: an int, or 'auto' = visible GPUs/NPUs, else 1 "
                        "(env NPROC_PER_NODE, default auto)")
    g.add_argument("--node-rank", type=int, default=None, help="this node's rank (env NODE_RANK)")
    g.add_argument("--master-addr", default=None, help="rendezvous host (env MASTER_ADDR)")
    g.add_argument("--master-port", type=int, default=None,
                   help=f"rendezvous port (env MASTER_PORT, default {DEFAULT_PORT})")
    g.add_argument("--rdzv-endpoint", default=None,
                   help="host:port of the c10d rendezvous (env RDZV_ENDPOINT, default MASTER_ADDR:MASTER_PORT)")
    g.add_argument("--rdzv-id", default=None, help="job id shared by all nodes (env RDZV_ID, default verl-speco)")
    g.add_argument("--rdzv-backend", choices=("c10d", "static"), default="c10d",
                   help="multi-node rendezvous (default c10d)")
    g.add_argument("--dry-run", action="store_true", help="print the command that would run and exit 0")
    return parser


def _auto_nproc() -> int:
    from verl_speco.device import accelerator_count

    return max(1, accelerator_count())


def node_sizes(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[int, int]:
    """(nodes, processes per node) from the arguments, else the environment."""
    nnodes = args.nnodes if args.nnodes is not None else int(env.get("NNODES", "1"))
    raw = args.nproc_per_node if args.nproc_per_node is not None else env.get("NPROC_PER_NODE", "auto")
    nproc = _auto_nproc() if str(raw) == "auto" else int(raw)
    if nnodes < 1 or nproc < 1:
        raise LaunchError(f"--nnodes={nnodes} --nproc-per-node={nproc}: both must be >= 1")
    return nnodes, nproc


def build_command(args: argparse.Namespace, env: Mapping[str, str] | None = None,
                  python: str | None = None) -> tuple[list[str], bool]:
    """(argv, uses_torchrun). Raises LaunchError naming a missing or bad argument."""
    env = os.environ if env is None else env
    python = python or sys.executable
    nnodes, nproc = node_sizes(args, env)
    entry = ["-m", ENTRY_MODULE]
    if args.config_dir:
        entry += ["--config-dir", os.path.abspath(args.config_dir)]
    if args.config_name != DEFAULT_CONFIG_NAME:
        entry += ["--config-name", args.config_name]
    if args.print_config:
        entry.append("--print-config")
    entry += list(args.overrides)
    if nnodes == 1 and nproc == 1:
        return [python, *entry], False
    run = [python, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1:
        return [*run, "--standalone", "--nnodes=1", *entry], True
    addr = args.master_addr or env.get("MASTER_ADDR")
    port = args.master_port or int(env.get("MASTER_PORT", DEFAULT_PORT))
    node_rank = args.node_rank if args.node_rank is not None else env.get("NODE_RANK")
    run.append(f"--nnodes={nnodes}")
    if args.rdzv_backend == "static":
        if addr is None or node_rank is None:
            raise LaunchError(f"--nnodes={nnodes} with --rdzv-backend static needs --master-addr (or MASTER_ADDR) "
                              f"and --node-rank (or NODE_RANK); got master_addr={addr!r}, node_rank={node_rank!r}")
        return [*run, f"--node-rank={int(node_rank)}", f"--master-addr={addr}", f"--master-port={port}",
                *entry], True
    endpoint = args.rdzv_endpoint or env.get("RDZV_ENDPOINT") or (f"{addr}:{port}" if addr else None)
    if endpoint is None:
        raise LaunchError(f"--nnodes={nnodes} needs a rendezvous: --rdzv-endpoint host:port, or --master-addr "
                          "(env RDZV_ENDPOINT / MASTER_ADDR); none was given")
    rdzv_id = args.rdzv_id or env.get("RDZV_ID", "verl-speco")
    run += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}"]
    if node_rank is not None:
        run.append(f"--node-rank={int(node_rank)}")
    return [*run, *entry], True


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        cmd, torchrun = build_command(args)
    except (LaunchError, ValueError) as err:
        parser.error(str(err))
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    if not torchrun:
        from verl_speco.train import entry

        return entry.main(cmd[3:])
    if not args.print_config:  # fail once, here, rather than in every rank
        from verl_speco.train.preflight import USER_ERRORS, check_inputs, report

        nnodes, nproc = node_sizes(args, os.environ)
        try:
            check_inputs(load_config(args.overrides, args.config_name, args.config_dir), nnodes * nproc)
        except USER_ERRORS as err:
            return report(err)
    return _torchrun(cmd[3:])


def _torchrun(argv: list[str]) -> int:
    """`python -m torch.distributed.run ARGV`, in this process, without torchrun's own report of a
    failed rank: a rank that stopped on a user error has printed its line and exited 2, so the
    launcher exits 2 too; any other failure (a bug) raises with torchrun's summary."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except ChildFailedError as err:
        codes = [f.exitcode for f in err.failures.values()]
        if 2 in codes and all(c == 2 or c < 0 for c in codes):  # < 0: stopped by torchrun after the failure
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
