"""Reading LeRobot's saved checkpoints, for every family that imports them (``vla-accel bundle
import --lerobot``): reader (the layout all of them share: config.json, the processors and their
statistics, model.safetensors, the camera features, the typed import options, the bundle
written), paligemma (the PaliGemma and Gemma-expert weights pi0 and pi05 share). A family's
own ``lerobot_import`` keeps only what differs: its checks, its weight names, its options."""
