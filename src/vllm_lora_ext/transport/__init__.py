"""Memory and hand-over: host arenas, shared files, pinning, CUDA streams and GPU staging (the process state)."""
