"""DDTree inside SGLang 0.5.23: a general plugin (entry point `sglang.srt.plugins:ddtree`).

Nothing here imports sglang at module import time: SGLang loads plugins in every process
(launcher, schedulers, detokenizer), and the heavy speculative modules only import on GPU
hosts. `plugin.register()` is the entry point; `gate` is the static compatibility gate
(stdlib only, runs on a host before anything is installed).
"""
