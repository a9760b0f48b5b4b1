import sys

from worker.app.cli import main

sys.exit(main())
