"""The machine a benchmark ran on, as every report records it (:func:`machine_info`): CPUs,
the threads torch uses, library versions and the load when the run ended."""

from __future__ import annotations

import os
import platform
from typing import Any

import numpy as np


def machine_info() -> dict[str, Any]:
    import torch

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
