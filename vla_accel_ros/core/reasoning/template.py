"""Ground-truth reasoning for the simulator's scripted demonstrations.

A reasoning policy (an ``ar`` bundle with ``reasoning_words``) writes, before its action
tokens, an embodied chain of thought in the manner of ECoT: a plan that holds for the whole
episode, the current subtask and motion, the grippers' state and where the object is. Training
labels and the eval's ground truth both come from :func:`reasoning_text`, computed from what
the demonstration really did at that frame:

* the subtask, the motion and where the cube is: from the control step, on the schedule of the
  scripted demonstration (``sim.scripted.TransferCubeScript``'s waypoint steps; a test checks
  the two agree);
* each gripper open or closed: from the measured joint state.

So the text changes when the scene does and stays word for word the same otherwise, which is
what makes it worth reusing across frames.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vla_accel_ros.core.errors import ConfigError
from vla_accel_ros.core.text import words_of


@dataclass(frozen=True)
class Phase:
    start: int  # first control step of the phase
    subtask: str
    move: str
    cube: str


# transfer_cube: the right arm grasps (80-100), lifts to the middle (100-140), the left arm
# reaches (150-175) and closes (180-195), the right lets go (200-210), both back off (220-).
TRANSFER_CUBE_PHASES = (
    Phase(0, "reach above the cube", "right arm forward and up", "on the table"),
    Phase(50, "lower the right gripper", "right arm down to the cube", "on the table"),
    Phase(80, "grasp the cube", "close the right gripper", "on the table"),
    Phase(100, "lift the cube", "right arm up to the middle", "in the right gripper"),
    Phase(140, "wait for the left arm", "hold still", "in the right gripper"),
    Phase(150, "reach with the left arm", "left arm to the cube", "in the right gripper"),
    Phase(180, "grasp with the left arm", "close the left gripper", "in both grippers"),
    Phase(200, "release the cube", "open the right gripper", "in the left gripper"),
    Phase(220, "carry the cube away", "both arms back", "in the left gripper"),
)
TRANSFER_CUBE_PLAN = "grasp the cube with the right arm , lift it to the middle , pass it to the left arm , then let go"

# Joint-state indices of the grippers (ALOHA order: left arm 0-6, right arm 7-13) and the
# normalized opening above which a gripper counts as open.
LEFT_GRIPPER, RIGHT_GRIPPER = 6, 13
OPEN_ABOVE = 0.8


@dataclass(frozen=True)
class ReasoningTemplate:
    task: str
    plan: str
    phases: tuple[Phase, ...]

    def phase(self, step: int) -> Phase:
        current = self.phases[0]
        for p in self.phases:
            if step >= p.start:
                current = p
        return current

    def text(self, step: int, state: np.ndarray) -> str:
        """The reasoning at control step ``step`` (0-based) with joint state ``state`` [14]."""
        if state is None or len(state) <= RIGHT_GRIPPER:
            raise ConfigError(f"reasoning needs the {RIGHT_GRIPPER + 1}-joint ALOHA state, got {None if state is None else len(state)}")
        p = self.phase(int(step))

        def grip(i: int) -> str:
            return "open" if float(state[i]) > OPEN_ABOVE else "closed"

        return (
            f"plan : {self.plan} . subtask : {p.subtask} . move : {p.move} . "
            f"grippers : right {grip(RIGHT_GRIPPER)} , left {grip(LEFT_GRIPPER)} . cube : {p.cube} ."
        )

    def words(self) -> tuple[str, ...]:
        """Every word the template can write, in first-use order (a bundle's ``reasoning_words``)."""
        texts = [f"plan : {self.plan} . subtask : . move : . grippers : right open closed , left . cube : ."]
        texts += [f"{p.subtask} {p.move} {p.cube}" for p in self.phases]
        seen: dict[str, None] = {}
        for t in texts:
            for w in words_of(t):
                seen.setdefault(w, None)
        return tuple(seen)

    def max_tokens(self) -> int:
        zeros = np.zeros(RIGHT_GRIPPER + 1)
        return max(len(words_of(self.text(p.start, zeros))) for p in self.phases)


TEMPLATES = {"transfer_cube": ReasoningTemplate("transfer_cube", TRANSFER_CUBE_PLAN, TRANSFER_CUBE_PHASES)}


def template_for(task: str) -> ReasoningTemplate:
    try:
        return TEMPLATES[task]
    except KeyError:
        raise ConfigError(f"no reasoning template for task {task!r}; there is one for {', '.join(TEMPLATES)}") from None
