"""The robot side of the ROS graph, without ROS: everything the camera, policy and action
controller nodes decide, as plain Python and NumPy so it is unit-tested without rclpy.

Modules:
    ``images``       raw ``sensor_msgs/Image`` fields -> RGB uint8, compressed decoding, the one resize
    ``topics``       the ALOHA topic conventions (cameras, joint states, actions, episodes)
    ``observation``  the one observation rule: frames (max age / skew, resize) and state halves,
                     both end to end for bags; latest-only slots and the observation channel
    ``inference``    the policy node's worker: which observation, state, resets, statistics
    ``state``        joint-state topics -> the policy's state vector; gripper maps
    ``kinematics``   ViperX 300 s forward kinematics (ALOHA's follower arm)
    ``motion``       end-effector / joint speed estimates and the coarse|fine switch
    ``safety``       joint limits, per-step clamp, watchdog, e-stop and enable state
    ``control_loop`` the action controller's tick: scheduler, watchdog, safety filter, motion
                     switch, request gating (the controller node calls it from its timer)
    ``loop_stats``   control-loop rate, jitter and latency statistics for diagnostics
    ``config``       the validated configs the nodes mirror as ROS parameters
"""
