"""Hugging Face families and folders: configs, loading into any layout of ReaLModel and saving back."""
