import sys

from splitserve.cluster.worker.worker import main

sys.exit(main(sys.argv[1:]))
