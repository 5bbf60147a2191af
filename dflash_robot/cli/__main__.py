import sys

from dflash_robot.cli import main

sys.exit(main())
