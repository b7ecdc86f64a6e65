"""``python -m inference_service``: the same as the ``inference-service`` command."""

import sys

from inference_service.cli import main

sys.exit(main())
