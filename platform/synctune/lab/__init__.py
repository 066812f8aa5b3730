"""The lab: emulated multi-node clusters on one machine. Each node is a network namespace
whose link is shaped with ``tc``, so local trials see bandwidth-bound synchronization as real
clusters do (loopback alone makes every collective a memory copy).

Lab presets (``lab-2x2``, ``lab-4x1``, ``lab-2x1``, ``lab-b9``, ``lab-b12``) are cluster specs
whose link speeds are AutoDist's scaled by ``LAB_SCALE``; ``lab_up`` builds one,
``lab_attach`` tells launchers where each node lives, ``calibrate`` measures the links.
"""

from .calibrate import calibrate, calibrated_spec, calibration_path, save_calibration
from .netns import LabNetwork, check_lab_support, lab_attach, lab_down, lab_prefix, lab_status, lab_up

__all__ = ["lab_up", "lab_down", "lab_status", "lab_attach", "lab_prefix", "check_lab_support", "LabNetwork",
           "calibrate", "calibrated_spec", "calibration_path", "save_calibration"]
