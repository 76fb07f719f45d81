"""Forward kinematics of the Interbotix ViperX 300 s (6 DOF), ALOHA's follower arm.

Product of exponentials in the space frame (the arm's ``base_link``), with the screw axes and
home pose Interbotix publishes for the vx300s (``interbotix_xs_modules`` ``mr_descriptions``),
which follow from the URDF link offsets:

    waist at z 0.079 + shoulder 0.04805 = 0.12705 m; elbow 0.05955 m forward, 0.3 m up
    (z 0.42705); forearm roll, wrist angle 0.3 m further (x 0.35955); end effector
    (``ee_gripper_link``) at x 0.536494, z 0.42705 with every joint at 0.

Approximations, fine for a speed estimate: the tool point is ``ee_gripper_link`` (between the
fingers, not the fingertips); the gripper opening is ignored; the two ALOHA arms' base poses
are not needed because speeds are invariant to a fixed base rotation about z (xy and z split
assumes both bases are mounted upright, as on ALOHA).
"""

from __future__ import annotations

import numpy as np

# Screw axes [w, v] in the space frame, one row per joint (waist .. wrist_rotate).
VX300S_SLIST = np.array(
    [
        [0.0, 0.0, 1.0, 0.0, 0.0, 0.0],
        [0.0, 1.0, 0.0, -0.12705, 0.0, 0.0],
        [0.0, 1.0, 0.0, -0.42705, 0.0, 0.05955],
        [1.0, 0.0, 0.0, 0.0, 0.42705, 0.0],
        [0.0, 1.0, 0.0, -0.42705, 0.0, 0.35955],
        [1.0, 0.0, 0.0, 0.0, 0.42705, 0.0],
    ]
)
VX300S_HOME = np.array(
    [
        [1.0, 0.0, 0.0, 0.536494],
        [0.0, 1.0, 0.0, 0.0],
        [0.0, 0.0, 1.0, 0.42705],
        [0.0, 0.0, 0.0, 1.0],
    ]
)
# Joint limits (rad) from the vx300s URDF / interbotix_xs_sdk motor configs.
VX300S_LIMITS = {
    "waist": (-3.14158, 3.14158),
    "shoulder": (-1.85005, 1.25664),
    "elbow": (-1.76278, 1.6057),
    "forearm_roll": (-3.14158, 3.14158),
    "wrist_angle": (-1.8675, 2.23402),
    "wrist_rotate": (-3.14158, 3.14158),
}


def _skew(w: np.ndarray) -> np.ndarray:
    return np.array([[0.0, -w[2], w[1]], [w[2], 0.0, -w[0]], [-w[1], w[0], 0.0]])


def screw_exp(screw: np.ndarray, theta: float) -> np.ndarray:
    """exp([S] theta) for a unit-rotation screw S = [w, v] (|w| = 1).  # [4, 4]"""
    w, v = screw[:3], screw[3:]
    W = _skew(w)
    W2 = W @ W
    s, c = np.sin(theta), np.cos(theta)
    R = np.eye(3) + s * W + (1.0 - c) * W2  # Rodrigues
    p = (np.eye(3) * theta + (1.0 - c) * W + (theta - s) * W2) @ v
    T = np.eye(4)
    T[:3, :3], T[:3, 3] = R, p
    return T


def fk(q: np.ndarray, slist: np.ndarray = VX300S_SLIST, home: np.ndarray = VX300S_HOME) -> np.ndarray:
    """End-effector pose in the arm's base frame for joint angles ``q`` [6].  # [4, 4]"""
    q = np.asarray(q, np.float64).reshape(-1)
    if q.shape[0] != slist.shape[0]:
        raise ValueError(f"fk needs {slist.shape[0]} joint angles, got {q.shape[0]}")
    T = np.eye(4)
    for screw, theta in zip(slist, q):
        T = T @ screw_exp(screw, float(theta))
    return T @ home


def rotation_angle(R_a: np.ndarray, R_b: np.ndarray) -> float:
    """Angle (rad) of the rotation taking R_a to R_b."""
    c = (np.trace(R_a.T @ R_b) - 1.0) / 2.0
    return float(np.arccos(np.clip(c, -1.0, 1.0)))
