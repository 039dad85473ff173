"""Builders: artefacts that runs read (a Qwen3-shaped checkpoint, a tiny reward model)."""
