"""Importable as top-level `sgl_kernel` once startup puts this folder on sys.path."""
