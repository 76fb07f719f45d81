"""The thin ROS 2 layer: nodes, parameter mirroring, message conversions and the graph
description. The only part of the package that imports rclpy (``graph`` does not).

The nodes share the machine's cores with a 50 Hz control loop and the DDS threads, so OpenMP
threads (torch on CPU) must not busy-wait for work: ``OMP_WAIT_POLICY=PASSIVE`` unless the
environment says otherwise. This has to be set before torch is first imported, hence here.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
