"""``infer tp-worker``: one tensor-parallel rank for an engine on another host."""

from __future__ import annotations

import logging

import click

from infer.engine.tensor_parallel import master_address, run_worker, threads_per_rank


@click.command("tp-worker", epilog="CONFIG is a YAML file or a shipped config name; OVERRIDES are key=value.")
@click.argument("config")
@click.argument("overrides", nargs=-1)
@click.option("--rank", type=int, required=True, help="This rank (1 .. parallel.tensor_parallel_size - 1).")
def tp_worker_command(config: str, overrides: tuple[str, ...], rank: int) -> None:
    """Run one tensor-parallel rank on this host for an engine on another (same CONFIG and OVERRIDES as rank 0's,
    whose parallel.master_addr and master_port, or $MASTER_ADDR and $MASTER_PORT, name where rank 0 listens).
    Exits when rank 0 stops."""
    from infer.config import load_config

    resolved = load_config(config, list(overrides))
    size = resolved.parallel.tensor_parallel_size
    if not 1 <= rank < size:
        raise click.BadParameter(f"must be 1 .. {size - 1} (parallel.tensor_parallel_size={size})", param_hint="--rank")
    addr, port = master_address(resolved, need_port=True)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(name)s: %(message)s")
    run_worker(resolved.to_dict(), rank, addr, port, threads_per_rank(resolved, 1))
