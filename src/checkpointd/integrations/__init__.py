"""Framework plugins: Lightning's CheckpointIO, accelerate's Accelerator, the transformers
Trainer and torchtitan's checkpoint manager."""
