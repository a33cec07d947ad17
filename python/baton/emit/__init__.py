"""The emitter: a rank's typed program (``_core.RankProgram``) to XLA programs. One rank's
loop as traced code (``loop_program.py``) in the table or rolled form (``rank_table.py``,
``rolling.py``), its transfers as FFI calls (``rank_transfers.py``, ``ffi.py``), one program for
a whole one-rank step (``single_program.py``) or for several ranks of a process
(``shared.py``). Imports only ``planning``, ``tracing`` and the base modules."""
