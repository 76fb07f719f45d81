"""File formats without ROS: rosbag2 bags (MCAP, sqlite3) through ``rosbags``, one module per job.

Modules:
    ``bag_file``      storages, message type names, the typestore, open/close shared by both sides
    ``bag_writer``    :class:`BagWriter`: images, joint states, strings, ... into a new bag
    ``bag_reader``    :class:`BagReader`: metadata, decoded messages, synchronized samples
    ``sim_recorder``  :class:`FrameRecorder`: simulator frames in the ALOHA topic layout
    ``episodes``      per-episode summaries and the text of ``vla-accel bag inspect``
    ``recording``     a live graph's serialized messages into a bag (the ROS-free half of the recorder)
    ``lerobot_export`` bags to a LeRobotDataset v3.0, written by ``lerobot_dataset_worker`` in LeRobot's Python

The topic conventions themselves live in :mod:`vla_accel_ros.core.robot.topics`.
"""
