"""Draft training: self-distillation data, the block-diffusion objective, and the loop."""
