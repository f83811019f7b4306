"""Integrations of megatron-muon into other training loops (Megatron-LM: ``megatron_lm``)."""
