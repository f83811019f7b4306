"""torchrun restarts (``--max-restarts``): each attempt's process group on a store of its own.

What goes wrong without it (torch 2.13, megatron-core 0.19.2, measured on 2 gloo ranks under
``torchrun --nproc-per-node 2 --max-restarts 1``, one rank SIGKILLed in the first attempt): the
restarted ranks stop in process-group setup, with ``Gloo connectFullMesh failed ... Connection
refused`` or a hang until the timeout, and the job never reaches ``--load``. The cause is the
store. torchrun's agent keeps one TCPStore for the whole job: the static rendezvous creates it once
and hands it to every attempt, the c10d (dynamic) rendezvous shares its server likewise, and the
workers are told to use it (``TORCHELASTIC_USE_AGENT_STORE=True``; ``MASTER_ADDR``/``MASTER_PORT``
name it). ``init_process_group``'s ``env://`` rendezvous connects a client to that store and adds
only the fixed prefix ``default_pg`` (torch's ``rendezvous._create_c10d_store`` says "We create a
new TCPStore for every retry so no need to add prefix for each attempt", which the agents above no
longer do). So a restarted rank finds every key the dead attempt wrote: gloo reads the dead ranks'
listening addresses and connects to closed ports; subgroups (``new_group``, Megatron's
tensor/data-parallel groups) use the same store and keys.

NCCL on GPUs takes the same path: ``ProcessGroupNCCL`` exchanges its ``ncclUniqueId`` through the
same store (rank 0 ``set``s it, the others ``get`` it, under the same group prefix and the
communicator counter that restarts from 0 in a new process), so a restarted rank can read the dead
attempt's id before rank 0 writes the new one and the communicators never form (a hang until the
NCCL timeout). Read from torch's code, not run (no GPU here).

The fix: under torchrun's agent store, every attempt's default process group is created on
``PrefixStore("megatron_muon/attempt_<TORCHELASTIC_RESTART_COUNT>", <client of that store>)``, so
an attempt never reads another's keys (subgroups inherit the prefix from the default group's
store). It applies on every attempt, the first too: one code path, which every torchrun launch
exercises, rather than one taken only after a failure (attempt 0's keys differ from stock torch's
by the prefix only, and nothing else reads them). Outside torchrun, or when the agent store is not
used (each attempt then starts its own store on rank 0), nothing changes.

- Megatron-LM's loop: ``patch()`` (applied by ``megatron_lm.install()``, so also by
  ``python -m megatron_muon.pretrain``) wraps ``_initialize_distributed`` of
  ``megatron.training.initialize`` (what ``initialize_megatron`` calls) so that a ``store`` of
  None becomes this one; a store the caller passes (in-process restart's) is kept. Checked
  against megatron-core 0.19.2.
- A custom trainer calls ``init_process_group(backend)`` here instead of torch's.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from megatron_muon.integrations.megatron_version import check_megatron_core_version

__all__ = ["attempt_store", "init_process_group", "patch", "restart_count"]

_MARK = "_megatron_muon_attempt_store"
# torch.distributed's default process-group timeout (default_pg_timeout: 10 minutes).
DEFAULT_TIMEOUT = timedelta(minutes=10)


def restart_count() -> int | None:
    """This attempt's number under torchrun (0 first, 1 after one restart, ...), or None outside
    torchrun (``TORCHELASTIC_RESTART_COUNT`` unset)."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return int(count) if count is not None else None


def attempt_store(timeout: timedelta = DEFAULT_TIMEOUT) -> dist.Store | None:
    """A client of torchrun's agent store under this attempt's prefix, or None where not needed.

    None outside torchrun and when the workers are not told to use the agent's store
    (``TORCHELASTIC_USE_AGENT_STORE`` other than ``True``): torch's ``env://`` is then right.
    Connects to ``MASTER_ADDR``:``MASTER_PORT`` (the agent store) as a client.
    """
    count = restart_count()
    if count is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"megatron_muon/attempt_{count}", client)


def init_process_group(
    backend: str | None = None, *, timeout: timedelta | None = None, **kwargs: Any
) -> None:
    """``torch.distributed.init_process_group`` that survives torchrun restarts.

    Under torchrun's agent store: on ``attempt_store(timeout)``, with ``RANK`` and ``WORLD_SIZE``
    from the environment; elsewhere torch's own ``env://``. ``kwargs`` go to torch
    (``device_id``, ``pg_options``, ...).
    """
    store = attempt_store(timeout or DEFAULT_TIMEOUT)
    if store is None:
        dist.init_process_group(backend, timeout=timeout, **kwargs)
        return
    dist.init_process_group(
        backend,
        store=store,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
        **kwargs,
    )


def patch() -> None:
    """Megatron's ``_initialize_distributed`` gets ``attempt_store()`` when given no store.

    Idempotent. Raises ``RuntimeError`` on a megatron-core outside the supported range.
    """
    check_megatron_core_version(__name__)
    initialize: Any = importlib.import_module("megatron.training.initialize")
    if getattr(initialize._initialize_distributed, _MARK, False):
        return
    initialize._initialize_distributed = _on_attempt_store(initialize._initialize_distributed)


def _megatron_timeout() -> timedelta:
    """``--distributed-timeout-minutes`` (what Megatron passes to ``init_process_group``)."""
    from megatron.training import get_args

    return timedelta(minutes=get_args().distributed_timeout_minutes)


def _on_attempt_store(initialize_distributed: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(initialize_distributed)

    @functools.wraps(initialize_distributed)
    def initialize_distributed_on_attempt_store(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("store") is None and not dist.is_initialized():
            bound.arguments["store"] = attempt_store(_megatron_timeout())
        return initialize_distributed(*bound.args, **bound.kwargs)

    setattr(initialize_distributed_on_attempt_store, _MARK, True)
    return initialize_distributed_on_attempt_store
