import os

# Ranks spawned by tests share 2 cores; keep each process single-threaded.
os.environ.setdefault("OMP_NUM_THREADS", "1")
