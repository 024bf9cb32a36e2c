"""Pure maths of cutting GEMMs: tiles and their assembly (``tiles``), the cost model
(``costmodel``) and the planner that picks each GEMM's partition by predicted makespan
(``planner``). Arrays and numbers in, arrays and numbers out: no clock, no I/O, no store.
"""
