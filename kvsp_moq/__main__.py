import sys

from kvsp_moq.cli import main

sys.exit(main())
