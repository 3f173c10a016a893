import sys

from tpmap.cli import main

sys.exit(main())
