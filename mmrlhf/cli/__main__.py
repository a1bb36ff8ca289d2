import sys

from mmrlhf.cli import main

sys.exit(main())
