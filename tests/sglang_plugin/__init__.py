"""Test helpers for the SGLang plugin (the real sglang==0.5.23 files, fetched and cached)."""
