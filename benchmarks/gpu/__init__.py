"""`make gpu-check` and `make gpu-wheelhouse`: the prepared first run on a CUDA machine (see benchmarks/gpu_check.py).

plan.py: the steps and budgets; steps/: one module per step; record.py: what a step reports; replay.py: what
the CUDA steps share; cores.py: the cores carried in and exported there; wheelhouse.py and imports.py: the
wheels the image lacks and the proof they cover every import; dry_run.py: the CPU half.
"""
