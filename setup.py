"""pip installs the Python package here; colcon uses CMakeLists.txt (ament_cmake).

The version is read from package.xml so the two cannot disagree.
"""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
PACKAGE = "vla_accel_ros"
VERSION = re.search(r"<version>([^<]+)</version>", (HERE / "package.xml").read_text()).group(1)

NODES = ("camera_node", "policy_node", "action_controller_node", "aloha_sim_node", "synthetic_sensors_node")


def share(subdir: str) -> tuple[str, list[str]]:
    files = sorted(str(p.relative_to(HERE)) for p in (HERE / subdir).glob("*") if p.is_file())
    return (f"share/{PACKAGE}/{subdir}", files)


def share_tree(subdir: str) -> list[tuple[str, list[str]]]:
    """Every directory under ``subdir`` with its files (the trained bundles in bundles/)."""
    dirs = [d for d in sorted((HERE / subdir).rglob("*")) if d.is_dir()] if (HERE / subdir).is_dir() else []
    return [share(str(d.relative_to(HERE))) for d in dirs]


setup(
    version=VERSION,
    packages=find_packages(include=[PACKAGE, f"{PACKAGE}.*"]),
    data_files=[
        (f"share/{PACKAGE}", ["package.xml"]),
        ("share/ament_index/resource_index/packages", [f"resource/{PACKAGE}"]),
        share("config"),
        share("launch"),
        *share_tree("bundles"),
    ],
    entry_points={
        "console_scripts": [f"vla-accel = {PACKAGE}.cli:main"]
        + [f"{n} = {PACKAGE}.ros.{n}:main" for n in NODES],
    },
)
