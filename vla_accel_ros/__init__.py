"""vla_accel_ros: fast Vision-Language-Action policies for ROS 2 robots.

Kept import-light on purpose: the rosidl-generated ``vla_accel_ros.msg`` imports this
module, so nothing heavy (torch, rclpy) may be imported here.
"""

# The generated interfaces (``vla_accel_ros.msg``) are installed by the rosidl pipeline into
# a second directory named ``vla_accel_ros`` (site-packages or a colcon install space). When
# this module is imported from a source tree, extend the package path so both halves are seen
# as one package (what catkin did in ROS 1; see ros2/rosidl_python#141).
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

__version__ = "0.1.0"
