"""The ROS-free core: engine, models, bundles, token cache, pruning and scheduling.

Nothing under ``vla_accel_ros.core`` may import rclpy; ``test/test_core_imports.py`` proves it.
"""
