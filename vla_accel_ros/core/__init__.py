"""The ROS-free core: engine, KV cache, bundles, token cache, prefix planning, scheduling, the
policy interface (``types``) and the robot-side logic the nodes call (``robot``).

Nothing under ``vla_accel_ros.core`` imports rclpy, nor the package's io, sim, models, bench,
ros or cli rooms: ``test/test_core_imports.py`` and ``test/test_layering.py`` prove it.
"""
