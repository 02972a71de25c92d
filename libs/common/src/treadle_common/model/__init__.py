"""Model-side helpers shared by services: LoRA adapters, exporting a version as an HF directory."""
