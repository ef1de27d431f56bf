"""Ground floor: dtype names, atomic files, devices, child processes, the exception classes."""
