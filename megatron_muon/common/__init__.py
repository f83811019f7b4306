"""What every layer shares: the option types (``options``), rank-0 printing (``console``) and the
Megatron-FSDP version compat (``megatron_fsdp_compat``). Imports nothing of the package."""
