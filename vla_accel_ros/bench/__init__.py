"""Benchmarks, measured side by side in one process: ``engine_bench`` (engine vs transformers),
``cache_bench`` (token cache on a synthetic moving arm), ``replay`` and ``report`` (a recorded
bag through several modes), ``scheduler_sim`` (scheduling modes on a simulated clock), with
``flops`` and ``stats``. They reach policies through public names only; nothing outside
bench and cli imports them.
"""
