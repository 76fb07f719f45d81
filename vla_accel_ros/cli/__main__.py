import sys

from vla_accel_ros.cli import main

sys.exit(main())
