"""Foreign formats in and out: torch.save, safetensors, Hugging Face folders, DCP."""
