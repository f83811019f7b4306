"""Test driver run by ``tests/torchrun.py`` on each rank: the example, plus what tests must see.

Runs ``examples/pretrain_gpt_megatron.py`` as ``__main__`` with the remaining arguments, then prints
this rank's row layout of every parameter (``MEGATRON_MUON_LAYOUT {name: [local_rows, rows]}``,
from the DTensors Megatron-FSDP hands the optimizer), what optimizer the loop got
(``MEGATRON_MUON_OPTIMIZER {"class": ..., "summary": [...]}``), the grad norm of every
``optimizer.step()`` at full precision (``MEGATRON_MUON_GRAD_NORMS [...]``, also when the run
stops with an error; the loop's log line rounds it to 3 decimals) and an end marker, so that a
test can tell a rank that finished from one that hung.

``MEGATRON_MUON_FILE_SIZE_LIMIT=<rank>:<iteration>:<bytes>`` in the environment: from the checkpoint
save at ``iteration`` on, that rank's process may write no file beyond ``bytes`` (``RLIMIT_FSIZE``,
with ``SIGXFSZ`` ignored so that a write past it fails with ``EFBIG``): the disk fills up during
that save.

``--megatron-muon-setenv NAME=VALUE`` sets a variable in this rank's environment before the
example starts, for a variable read when used (``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``: at each
``torch.load``): unlike ``run_megatron(env=...)``, it needs no launch zygote of its own (one
costs about 20 s).

``MEGATRON_MUON_DUMP_OPTIMIZER_STATE=<directory>`` in the environment: right after Megatron's
``setup_model_and_optimizer`` (so after its ``--load``), each rank writes its optimizer state as
the optimizer hands it to an ``fsdp_dtensor`` save, by param name, each tensor's local rows, to
``<directory>/rank<r>.pt`` (``{name: {key: tensor}}``): what the load put there, before any step.

``MEGATRON_MUON_NUDGE_WEIGHTS=1`` in the environment: every fp32 weight one ulp up after the
setup (and a ``--load``), before the first iteration (``tests/nudge.py``): a floor run
(``tests/run_comparison.py``'s ``floor_run``).

``--no-megatron-muon-install`` replaces the example's ``install()`` with the CPU stand-ins alone:
the run is stock ``megatron.training`` on CPU (the behaviour-preserved test).
"""

from __future__ import annotations

import functools
import json
import os
import resource
import runpy
import signal
import sys
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pretrain_gpt_megatron.py"
DONE_MARKER = "MEGATRON_MUON_DRIVER_DONE"
LAYOUT_MARKER = "MEGATRON_MUON_LAYOUT "
OPTIMIZER_MARKER = "MEGATRON_MUON_OPTIMIZER "
GRAD_NORMS_MARKER = "MEGATRON_MUON_GRAD_NORMS "
NO_INSTALL_FLAG = "--no-megatron-muon-install"
SETENV_FLAG = "--megatron-muon-setenv"
FILE_SIZE_LIMIT_VARIABLE = "MEGATRON_MUON_FILE_SIZE_LIMIT"
DUMP_STATE_VARIABLE = "MEGATRON_MUON_DUMP_OPTIMIZER_STATE"
NUDGE_VARIABLE = "MEGATRON_MUON_NUDGE_WEIGHTS"


def _rows(param: Any) -> list[int]:
    from torch.distributed.tensor import DTensor

    local = param.to_local() if isinstance(param, DTensor) else param
    return [int(local.shape[0]) if local.ndim else 1, int(param.shape[0]) if param.ndim else 1]


def _limit_file_size_from_a_save(training: Any) -> None:
    """``FILE_SIZE_LIMIT_VARIABLE``: one rank's disk fills up at one save (module docstring)."""
    import torch

    rank, iteration, size = (int(part) for part in os.environ[FILE_SIZE_LIMIT_VARIABLE].split(":"))
    save_checkpoint = training.save_checkpoint

    @functools.wraps(save_checkpoint)
    def save_checkpoint_on_a_full_disk(at_iteration: int, *args: Any, **kwargs: Any) -> Any:
        if at_iteration == iteration and torch.distributed.get_rank() == rank:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
            resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
        return save_checkpoint(at_iteration, *args, **kwargs)

    training.save_checkpoint = save_checkpoint_on_a_full_disk


def _set_environment(argv: list[str]) -> list[str]:
    """``argv`` without its ``SETENV_FLAG NAME=VALUE`` pairs, each set in ``os.environ``."""
    rest = []
    pairs = iter(argv)
    for arg in pairs:
        if arg == SETENV_FLAG:
            name, value = next(pairs).split("=", 1)
            os.environ[name] = value
        else:
            rest.append(arg)
    return rest


def _dump_optimizer_state(optimizer: Any, directory: str) -> None:
    """``DUMP_STATE_VARIABLE``: this rank's optimizer state by param name, local rows (module
    docstring). Collective (the state dict makes each param's state exist on every rank)."""
    import torch
    from torch.distributed.tensor import DTensor

    metadata = {"distrib_optim_sharding_type": "fsdp_dtensor"}
    state = optimizer.sharded_state_dict({}, is_loading=False, metadata=metadata)["state"]
    local = {
        name: {
            key: (value.to_local() if isinstance(value, DTensor) else value).clone()
            for key, value in values.items()
            if torch.is_tensor(value)
        }
        for name, values in state.items()
    }
    os.makedirs(directory, exist_ok=True)
    torch.save(local, os.path.join(directory, f"rank{torch.distributed.get_rank()}.pt"))


def main() -> None:
    argv = _set_environment(sys.argv[1:])
    if NO_INSTALL_FLAG in argv:
        argv.remove(NO_INSTALL_FLAG)
        import megatron_muon.integrations.megatron_lm as integration
        from megatron_muon import cpu_stand_ins

        def stand_ins_only(**_: Any) -> None:
            cpu_stand_ins.install_for_training()
            integration.use_shipped_dataset_helpers()  # packaging, not Muon: stock needs it too

        integration.install = stand_ins_only

    import megatron.training.training as training

    captured: dict[str, Any] = {}
    setup_model_and_optimizer = training.setup_model_and_optimizer

    def setup_and_capture(*args: Any, **kwargs: Any) -> Any:
        model, optimizer, scheduler = setup_model_and_optimizer(*args, **kwargs)
        if DUMP_STATE_VARIABLE in os.environ:
            _dump_optimizer_state(optimizer, os.environ[DUMP_STATE_VARIABLE])
        captured["optimizer"] = optimizer
        captured["model"] = model
        if os.environ.get(NUDGE_VARIABLE) == "1":  # a floor run (tests/run_comparison.py)
            from tests.nudge import nudge_weights

            nudge_weights(model)
        grad_norms = captured.setdefault("grad_norms", [])
        step = optimizer.step

        def recording_step(*step_args: Any, **step_kwargs: Any) -> Any:
            result = step(*step_args, **step_kwargs)
            grad_norms.append(None if result[1] is None else float(result[1]))
            return result

        optimizer.step = recording_step
        return model, optimizer, scheduler

    training.setup_model_and_optimizer = setup_and_capture
    if FILE_SIZE_LIMIT_VARIABLE in os.environ:
        _limit_file_size_from_a_save(training)
    sys.argv = [str(EXAMPLE), *argv]
    try:
        runpy.run_path(str(EXAMPLE), run_name="__main__")
    finally:  # a run that stops with an error still shows the steps it took
        print(GRAD_NORMS_MARKER + json.dumps(captured.get("grad_norms", [])), flush=True)

    layout: dict[str, list[int]] = {}
    for chunk in captured.get("model", []):
        for name, param in chunk.named_parameters():
            layout[name] = _rows(param)
    optimizer = captured.get("optimizer")
    described = {
        "class": type(optimizer).__name__,
        "summary": list(getattr(optimizer, "summary_lines", [])),
    }
    print(LAYOUT_MARKER + json.dumps(layout), flush=True)
    print(OPTIMIZER_MARKER + json.dumps(described), flush=True)
    print(DONE_MARKER, flush=True)


if __name__ == "__main__":
    main()
