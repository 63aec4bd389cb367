"""App layer: moepec wired into other training frameworks (Hugging Face transformers)."""
