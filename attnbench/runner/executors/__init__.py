"""Executors run cells and hand back rows: in measuring worker processes on this machine (``local``:
``local.WorkerExecutor`` with the ``worker`` entry point; one fresh process per cell with ``isolate``),
or on a Ray cluster (``ray``)."""
