"""``restart_store``: each torchrun attempt's keys under a prefix of their own; nothing changes
outside torchrun; Megatron's ``_initialize_distributed`` gets the store (single process)."""

from __future__ import annotations

import inspect
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_muon.integrations import restart_store


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_attempt_store_is_none_outside_torchrun_or_without_its_agent_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert restart_store.restart_count() is None
    assert restart_store.attempt_store() is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # rank 0 starts its own store
    assert restart_store.attempt_store() is None


def test_each_attempt_writes_under_its_own_prefix_of_the_agent_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = _free_port()
    # torchrun's agent store: one server for the whole job.
    agent = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("WORLD_SIZE", "2")
    for attempt in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        store = restart_store.attempt_store(timedelta(seconds=10))
        assert store is not None
        store.set("rank_0_address", f"written by attempt {attempt}")
    # The restarted attempt's key did not overwrite (or read) the dead attempt's.
    assert agent.get("megatron_muon/attempt_0/rank_0_address") == b"written by attempt 0"
    assert agent.get("megatron_muon/attempt_1/rank_0_address") == b"written by attempt 1"


def test_patch_gives_megatrons_initialize_distributed_the_attempt_store_once() -> None:
    from megatron.training import initialize

    restart_store.patch()
    restart_store.patch()  # idempotent
    wrapped = initialize._initialize_distributed
    assert getattr(wrapped, "_megatron_muon_attempt_store", False)
    assert not getattr(wrapped.__wrapped__, "_megatron_muon_attempt_store", False)
    assert "store" in inspect.signature(wrapped.__wrapped__).parameters
