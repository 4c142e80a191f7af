"""Coordinator side of intellect-node: rollout ingest, batch assembly with staleness rules,
the GRPO loss, FSDP2 training and checkpoint publishing."""
