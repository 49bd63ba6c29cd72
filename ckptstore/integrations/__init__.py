"""Where ckptstore plugs into training loops: background commits, Hugging Face Trainer, PyTorch Lightning."""
